"""The planner's search space and the exact bytes of every candidate, before anything runs.

Usage::

    from layercut.compress.workflow.planner.space import Layout, enumerate_candidates
    layout = Layout.of("path/to/checkpoint")          # shapes from the safetensors headers, no weights read
    layout.dense_bytes(kept=range(30), dtype="BF16")   # a depth cut written dense
    layout.quantized_bytes(kept=range(28), configs={name: (4, 64), ...})

What is counted: the bytes of the ``*.safetensors`` files a stage writes (what ``layercut eval``
reports as ``bytes``): every stored tensor's data plus each shard's 8-byte length prefix and
JSON header (padded to 8 bytes), emulating :class:`layercut.compress.core.shards.ShardWriter` (the
writer of the streamed prune and quantize paths, and of dense export) entry by entry, in the
order those paths write (tensor names, dtypes and shapes from the source's own headers and
the model skeleton on the meta device). JSON side files (config, tokenizer, index, reports) are
not counted. A quantized linear of ``in`` inputs, ``out`` outputs at (b bits, group size g)
writes ``qweight`` int32 [ceil(in·b/32), out], ``qzeros`` int32 [G, ceil(out·b/32)],
``scales`` fp16 [G, out], ``g_idx`` int32 [in] (G = in/g, or 1 for g = -1) and its bias in
fp16; every other tensor is written in the quantize stage's ``save_dtype`` (fp16); a tied head
is not stored. ``tests/test_plan.py`` checks these numbers against files the stages wrote.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from layercut.compress.core.arch import target_linears
from layercut.compress.core.units import parse_size
from layercut.compress.io.lazy import LazyModel
from layercut.compress.quant.solve.driver import linear_weight

ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1}
TORCH_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
MAX_SHARD = "2GB"  # the stages' shard size
Config = tuple[int, int]  # (bits, group size); -1 = one group per row


@dataclass(frozen=True)
class Tensor:
    """One stored tensor: its name inside its block (or the full name outside blocks), dtype, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    floating: bool = True

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_BYTES[self.dtype]


def shard_file_bytes(entries: Sequence[tuple[str, str, tuple[int, ...]]], max_shard: int | str = MAX_SHARD,
                     metadata: Mapping[str, str] | None = None) -> int:
    """Bytes of the safetensors files :class:`~layercut.compress.core.shards.ShardWriter` writes for ``entries``
    (name, dtype, shape) added in this order: the same shard splits, headers and padding."""
    limit = parse_size(max_shard)
    meta = {"format": "pt", **(metadata or {})}
    total, header, pending = 0, {}, 0

    def flush() -> int:
        text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
        return 8 + len(text) + (-len(text) % 8) + pending

    for name, dtype, shape in entries:
        size = math.prod(shape) * ELEMENT_BYTES[dtype]
        if header and pending + size > limit:
            total += flush()
            header, pending = {}, 0
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pending, pending + size]}
        pending += size
    return total + (flush() if header else 0)


@dataclass
class Layout:
    """What a checkpoint stores, block by block, in the order the stages write it."""

    prefix: str  # e.g. "model.layers"
    order: list[tuple[int | None, Tensor]]  # (block index or None, tensor) in state-dict order
    linears: list[tuple[str, ...]]  # per-block names of the target linears, forward order
    linear_shapes: dict[str, tuple[int, int, bool]]  # block-relative name -> (in, out, has_bias), per block 0..
    groups: tuple[tuple[str, ...], ...] = ()
    num_blocks: int = 0
    params: int = 0  # the source's parameters (tied ones once)
    block_linear_shapes: list[dict[str, tuple[int, int, bool]]] = field(default_factory=list)

    @classmethod
    def of(cls, path: str | Path) -> Layout:
        """Read ``path``'s layout from its headers and a meta-device skeleton (no weights)."""
        lazy = LazyModel(path)
        spec, prefix = lazy.spec, lazy.spec.layers_path()
        order: list[tuple[int | None, Tensor]] = []
        for name, value in lazy.model.state_dict(keep_vars=True).items():
            if name in lazy.tied or name not in lazy.names:
                continue
            dtype = TORCH_NAMES.get(str(value.dtype).removeprefix("torch."), "I64")
            block, rel = None, name
            if name.startswith(prefix + "."):
                index, _, rel = name[len(prefix) + 1:].partition(".")
                block = int(index)
            order.append((block, Tensor(rel, dtype, tuple(value.shape), value.is_floating_point())))
        per_block: list[dict[str, tuple[int, int, bool]]] = [{} for _ in range(lazy.num_blocks)]
        linears: list[list[str]] = [[] for _ in range(lazy.num_blocks)]
        for i, _g, full, module in target_linears(lazy.model, spec):
            rel = full[len(f"{prefix}.{i}."):]
            out_f, in_f = linear_weight(module, spec.conv1d).shape
            per_block[i][rel] = (int(in_f), int(out_f), getattr(module, "bias", None) is not None)
            linears[i].append(rel)
        return cls(prefix=prefix, order=order, linears=[tuple(x) for x in linears],
                   linear_shapes=per_block[0] if per_block else {}, groups=spec.groups,
                   num_blocks=lazy.num_blocks, params=lazy.num_params, block_linear_shapes=per_block)

    # ------------------------------------------------------------------ sizes
    @property
    def bf16_bytes(self) -> int:
        """The size unit of ``--target-size 40%``: 2 bytes per source parameter (a tied head once)."""
        return 2 * self.params

    def linear_inputs(self) -> set[int]:
        return {s[0] for b in self.block_linear_shapes for s in b.values()}

    def weights_in(self, blocks: Iterable[int]) -> int:
        """Weights of the quantized linears of ``blocks`` (what ``--avg-bits`` averages over)."""
        return sum(s[0] * s[1] for i in blocks for s in self.block_linear_shapes[i].values())

    def dense_entries(self, kept: Sequence[int], dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """A depth cut written dense (prune / export): state-dict order, kept blocks renumbered."""
        new = {old: j for j, old in enumerate(kept)}
        out = []
        for block, t in self.order:
            if block is not None and block not in new:
                continue
            name = t.name if block is None else f"{self.prefix}.{new[block]}.{t.name}"
            out.append((name, dtype if t.floating else t.dtype, t.shape))
        return out

    def dense_bytes(self, kept: Sequence[int], dtype: str = "BF16") -> int:
        return shard_file_bytes(self.dense_entries(kept, dtype))

    def quantized_entries(self, kept: Sequence[int], configs: Mapping[str, Config] | Config,
                          save_dtype: str = "F16") -> list[tuple[str, str, tuple[int, ...]]]:
        """A quantized checkpoint as the streamed quantize stage writes it: each block's unquantized
        tensors (a quantized linear's bias in fp16), then its packed linears; then the rest.

        ``configs``: one (bits, group size) for every linear, or full name (new numbering) -> config.
        """
        out: list[tuple[str, str, tuple[int, ...]]] = []
        for j, old in enumerate(kept):
            base = f"{self.prefix}.{j}."
            shapes = self.block_linear_shapes[old]
            for block, t in self.order:
                if block != old:
                    continue
                module, _, leaf = t.name.rpartition(".")
                if module in shapes:
                    if leaf == "bias":
                        out.append((base + t.name, "F16", t.shape))
                    continue
                out.append((base + t.name, save_dtype if t.floating else t.dtype, t.shape))
            for rel in self.linears[old]:
                in_f, out_f, _ = shapes[rel]
                bits, gs = configs if isinstance(configs, tuple) else configs[base + rel]
                groups = 1 if gs == -1 else in_f // gs
                out += [(f"{base}{rel}.qweight", "I32", ((in_f * bits + 31) // 32, out_f)),
                        (f"{base}{rel}.qzeros", "I32", (groups, (out_f * bits + 31) // 32)),
                        (f"{base}{rel}.scales", "F16", (groups, out_f)),
                        (f"{base}{rel}.g_idx", "I32", (in_f,))]
        out += [(t.name, save_dtype if t.floating else t.dtype, t.shape) for block, t in self.order if block is None]
        return out

    def quantized_bytes(self, kept: Sequence[int], configs: Mapping[str, Config] | Config,
                        save_dtype: str = "F16") -> int:
        return shard_file_bytes(self.quantized_entries(kept, configs, save_dtype))

    def fits(self, gs: int) -> bool:
        """Whether group size ``gs`` divides every quantized linear's inputs."""
        return gs == -1 or all(n % gs == 0 for n in self.linear_inputs())

    def mixed_avg_bits(self, kept: Sequence[int], target: int, pairs: Sequence[Config]) -> float:
        """The largest ``--avg-bits`` X (3 decimals) whose allocation over ``pairs`` is sure to fit
        ``target`` bytes: X·N/8 plus what the allocator's cost leaves out (g_idx, biases, the
        dense tensors, int32 padding of qweight/qzeros, headers), bounded from above."""
        n = self.weights_in(kept)
        fixed = self._fixed_bytes(kept)
        finest = min((g for _, g in pairs if g > 0), default=-1)  # the most groups any pair has
        # int32 rounding: at most one word per output column of qweight and per group row of qzeros
        slack = sum(4 * (out_f + (1 if finest == -1 else in_f // finest)) for i in kept
                    for in_f, out_f, _ in self.block_linear_shapes[i].values())
        header = max(self.quantized_bytes(kept, p) - self._data_bytes(kept, p) for p in pairs) \
            + 4 * len(self.quantized_entries(kept, pairs[0]))
        room = target - fixed - slack - header
        return math.floor(room * 8 / n * 1000) / 1000 if n else 0.0

    def allocator_bits(self, kept: Sequence[int], config: Config) -> float:
        """Average bits of ``config`` as ``--avg-bits`` prices it: n·b + groups·rows·(16 + b) over n."""
        b, gs = config
        n = self.weights_in(kept)
        cost = sum(in_f * out_f * b + (1 if gs == -1 else in_f // gs) * out_f * (16 + b) for i in kept
                   for in_f, out_f, _ in self.block_linear_shapes[i].values())
        return cost / n if n else 0.0

    def _data_bytes(self, kept: Sequence[int], config: Config) -> int:
        return sum(math.prod(s) * ELEMENT_BYTES[d] for _, d, s in self.quantized_entries(kept, config))

    def _fixed_bytes(self, kept: Sequence[int]) -> int:
        """Data bytes a quantized cut writes that the allocator does not price: the dense tensors,
        biases (fp16) and g_idx (int32 per input)."""
        total = 0
        for block, t in self.order:
            if block is not None and block not in kept:
                continue
            shapes = self.block_linear_shapes[block] if block is not None else {}
            module, _, leaf = t.name.rpartition(".")
            if module in shapes and leaf != "bias":
                continue
            total += math.prod(t.shape) * (2 if t.floating else ELEMENT_BYTES[t.dtype])
        total += sum(4 * s[0] for i in kept for s in self.block_linear_shapes[i].values())
        return total


# ---------------------------------------------------------------------------- candidates
@dataclass
class Candidate:
    """One point of the search space: a depth cut crossed with a quantization (or none)."""

    drop: int  # blocks removed
    kept_blocks: int
    quant: str  # "uniform", "mixed" or "dense"
    bits: int | None = None
    group_size: int | None = None
    avg_bits: float | None = None  # mixed: the budget handed to --avg-bits
    pairs: tuple[Config, ...] = ()  # mixed: the (bits, group size) pairs it picks from
    bytes: int = 0  # exact (uniform, dense) or an upper bound (mixed, before its allocation is known)
    bytes_exact: bool = True
    predicted_speedup: float = 1.0
    predicted_kl: float | None = None
    calibrated_kl: float | None = None  # predicted_kl with the RTN term rescaled by what verification learnt
    kl_depth: float | None = None
    kl_quant: float | None = None
    measured_kl: float | None = None
    measured_bytes: int | None = None
    verified: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.quant == "uniform":
            q = pair_label((self.bits, self.group_size))
        elif self.quant == "mixed":
            q = f"avg{self.avg_bits:g}[{','.join(pair_label(p) for p in self.pairs)}]"
        else:
            q = "bf16"
        return f"-{self.drop} blocks, {q}"

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["pairs"] = [pair_label(p) for p in self.pairs]
        d["label"] = self.label
        return d


def pair_label(p: Config) -> str:
    """(3, 64) -> ``3g64``, (4, -1) -> ``4ch``."""
    return f"{p[0]}ch" if p[1] == -1 else f"{p[0]}g{p[1]}"


def uniform_configs(layout: Layout, bits: Sequence[int], group_sizes: Sequence[int]) -> list[Config]:
    """Every (bits, group size) whose group size divides every quantized linear's inputs."""
    return [(b, g) for b in bits for g in group_sizes if layout.fits(g)]


def enumerate_candidates(layout: Layout, kept_by_drop: Mapping[int, Sequence[int]], target: int,
                         configs: Sequence[Config], mixed: bool = True, dense: bool = True) -> list[Candidate]:
    """Every candidate over the given depth cuts whose bytes fit ``target``.

    Per cut: each uniform config that fits and that no other fitting config dominates (at least
    as many bits in groups at least as fine: it cannot be expected to do worse, so the dominated
    one is neither predicted nor verified); the dense bf16 cut if it fits; and a mixed
    ``--avg-bits`` candidate filling the bytes left, over the two uniform configs around it on
    the cut's size/bits frontier, when it would spend more than the best fitting uniform one.
    """
    out: list[Candidate] = []
    for drop, kept in sorted(kept_by_drop.items()):
        n = layout.num_blocks
        speed = n / max(len(kept), 1)
        sizes = {c: layout.quantized_bytes(kept, c) for c in configs}
        fitting = [c for c in configs if sizes[c] <= target]
        for c in fitting:
            if any(dominates(o, c) for o in fitting):
                continue
            out.append(Candidate(drop, len(kept), "uniform", bits=c[0], group_size=c[1], bytes=sizes[c],
                                 predicted_speedup=speed))
        if dense:
            size = layout.dense_bytes(kept, "BF16")
            if size <= target:
                out.append(Candidate(drop, len(kept), "dense", bytes=size, predicted_speedup=speed))
        if not mixed:
            continue
        by_size = sorted(configs, key=lambda c: sizes[c])
        below = [c for c in by_size if sizes[c] <= target]
        above = [c for c in by_size if sizes[c] > target]
        if not below or not above:
            continue
        low, high = below[-1], above[0]
        x = layout.mixed_avg_bits(kept, target, (low, high))
        if x > layout.allocator_bits(kept, low) + 0.05 and low[0] != high[0]:
            out.append(Candidate(drop, len(kept), "mixed", avg_bits=x, pairs=(low, high), bytes=target,
                                 bytes_exact=False, predicted_speedup=speed,
                                 notes=["bytes: the budget (an upper bound); exact once allocated"]))
    return out


def dominates(a: Config, b: Config) -> bool:
    """``a`` has at least ``b``'s bits in groups at least as fine (-1, one group per row, is the
    coarsest), and is not ``b``.

    >>> dominates((4, 64), (3, -1)), dominates((4, -1), (3, 64)), dominates((3, 64), (3, 64))
    (True, False, False)
    """
    def fine(g: int) -> float:
        return math.inf if g == -1 else g

    return a != b and a[0] >= b[0] and fine(a[1]) <= fine(b[1])


def smallest_bytes(layout: Layout, max_drop: int, configs: Sequence[Config]) -> int:
    """The smallest size any candidate with at most ``max_drop`` blocks removed can reach
    (the biggest blocks removed, the smallest config)."""
    sizes = sorted(range(layout.num_blocks), key=lambda i: -layout.weights_in([i]))
    kept = sorted(set(range(layout.num_blocks)) - set(sizes[:max_drop]))
    return min(layout.quantized_bytes(kept, c) for c in configs)
