"""Data-driven layer scores from ONE pass of the capture driver, and the selections.

Usage::

    from layercut.compress.select import compute_scores, select_blocks, select_sublayers
    scores = compute_scores(model, calib, span=8)        # angular, BI, sublayer cosines
    select_blocks(scores, 8, "angular")                  # contiguous span l*..l*+7
    select_blocks(scores, 8, "block-influence")          # 8 lowest BI, any positions
    select_sublayers(scores, 8, "attn-cosine", "attention")
    scores.to_dict()                                     # JSON-able

Every stream is taken from :func:`layercut.calibrate.capture.run_blocks`: h_l = ``run.inputs``,
h_{l+1} = ``run.outputs()`` — for the last block that is the raw residual stream, never
transformers' ``hidden_states[-1]`` (which is after the final norm). Padding is masked
everywhere (the driver's ``run.masks``).

Memory: the last-token angular variant keeps only [N, D] per layer (L + 1 of them), so
d(l, n) is available for every span n. The all-token variant needs h_l and h_{l+n} at
every real token at once: a ring buffer of n + 1 layers' activations, about
(n + 1)·N·seq_len·D·4 bytes (fp32) including the two the driver holds anyway — e.g.
9 × 64 × 256 × 576 × 4 B ≈ 340 MB for SmolLM2 at span 8, ≈ 4.8 GB for a 7B model (D 4096)
at 64 × 512 tokens. It is only allocated when ``angular-all`` is requested.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from layercut.calibrate.capture import BlockRun, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.calibrate.stats import last_tokens
from layercut.compress.core.arch import arch_for
from layercut.compress.core.errors import LayercutError
from layercut.compress.select.cores import angle, best_span, cosine_sum, lowest, ranking, span_distances
from layercut.compress.select.gate_norm import gate_norm_from_model, gate_norm_scores
from layercut.compress.select.swap_kl import swap_kl_scores

DATA_METHODS = ("angular", "angular-all", "block-influence", "attn-cosine", "mlp-cosine")
BLOCK_METHODS = ("angular", "angular-all", "block-influence")
SUBLAYER_METHODS = ("attn-cosine", "mlp-cosine", "cosine", "joint", "gate-norm")


@dataclass
class LayerScores:
    """Per-layer scores of one model; lower = less important = removed first.

    ``block_influence[l]`` = 1 − E_t cos(h_l, h_{l+1}) (ShortGPT);
    ``attn_importance[l]`` / ``mlp_importance[l]`` = 1 − E_t cos(x, x + sublayer) (LLM-Drop);
    ``angular[l]`` = d(l, span) at the last real token, l = 0..L−span (Gromov et al.);
    ``angular_all[l]`` = the same over every real token;
    ``angular_spans[n][l]`` = last-token d(l, n) for every n in 1..L−1;
    ``gate_norm[l]`` = ‖W_Q W_Kᵀ‖_F per head (see :mod:`layercut.compress.select.gate_norm`);
    ``swap_kl`` = the swap diagnostic (see :mod:`layercut.compress.select.swap_kl`).
    A field is ``None`` when its method was not run.
    """

    num_layers: int
    span: int = 1
    samples: int = 0
    tokens: int = 0
    block_influence: list[float] | None = None
    attn_importance: list[float] | None = None
    mlp_importance: list[float] | None = None
    angular: list[float] | None = None
    angular_all: list[float] | None = None
    angular_spans: dict[int, list[float]] | None = None
    gate_norm: list[float] | None = None
    swap_kl: dict | None = None
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.angular_spans is not None:
            out["angular_spans"] = {str(k): v for k, v in self.angular_spans.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> LayerScores:
        data = dict(data)
        if data.get("angular_spans") is not None:
            data["angular_spans"] = {int(k): v for k, v in data["angular_spans"].items()}
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


def load_scores(path: str | Path) -> LayerScores:
    """Read the ``scores`` object of a ``layercut score -o`` file (or a bare to_dict())."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LayercutError(f"cannot read scores from {path}: {exc}") from exc
    return LayerScores.from_dict(data.get("scores", data))


class ScoreCollector:
    """Capture-driver callback that accumulates every requested score for every block."""

    def __init__(self, num_layers: int, span: int, methods: Sequence[str]):
        self.L, self.span, self.methods = num_layers, span, set(methods)
        self.bi: list[tuple[float, int]] = []
        self.attn: list[tuple[float, int]] = []
        self.mlp: list[tuple[float, int]] = []
        self.last_states: list[torch.Tensor] = []  # h_l at T: [N, D] float64, l = 0..L
        self.ring: collections.deque = collections.deque()  # (l, [h_l per micro-batch])
        self.all_tokens: list[tuple[float, int]] = [(0.0, 0)] * (num_layers - span + 1)
        self.tokens = 0

    def __call__(self, run: BlockRun) -> None:
        masks = run.masks
        if run.index == 0:
            self.tokens = int(sum(int(m.sum()) for m in masks))
        if {"attn-cosine", "mlp-cosine"} & self.methods:
            attn, mlp, outs = run.sublayer_outputs()  # one forward with two hooks
            a_sum, m_sum = [0.0, 0], [0.0, 0]
            for x, a, m, mask in zip(run.inputs, attn, mlp, masks):
                s, c = cosine_sum(x, x + a, mask)  # x: stream entering attention
                a_sum = [a_sum[0] + s, a_sum[1] + c]
                post = x + a  # stream entering the MLP (sequential-residual convention)
                s, c = cosine_sum(post, post + m, mask)
                m_sum = [m_sum[0] + s, m_sum[1] + c]
            self.attn.append(tuple(a_sum))
            self.mlp.append(tuple(m_sum))
        else:
            outs = run.outputs()
        if "block-influence" in self.methods:
            total = [0.0, 0]
            for x, y, mask in zip(run.inputs, outs, masks):
                s, c = cosine_sum(x, y, mask)
                total = [total[0] + s, total[1] + c]
            self.bi.append(tuple(total))
        if "angular" in self.methods:
            if run.index == 0:
                self.last_states.append(self._last(run.inputs, masks))
            self.last_states.append(self._last(outs, masks))  # h_{l+1}; h_L raw for the last block
        if "angular-all" in self.methods:
            self._push(run.index, run.inputs, masks)
            if run.is_last:
                self._push(run.index + 1, outs, masks)

    @staticmethod
    def _last(hs: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([last_tokens(h, m).double() for h, m in zip(hs, masks)])

    def _push(self, layer: int, hs: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        """Ring buffer of the last span + 1 layers' streams (references, no copies)."""
        self.ring.append((layer, hs))
        if len(self.ring) == self.span + 1:
            start, old = self.ring.popleft()
            total, count = 0.0, 0
            for a, b, mask in zip(old, hs, masks):
                d = angle(a, b)[mask.bool()]
                total, count = total + float(d.sum()), count + d.numel()
            self.all_tokens[start] = (total, count)

    def result(self, samples: int) -> LayerScores:
        def one_minus(pairs):
            return [1.0 - s / max(c, 1) for s, c in pairs]

        out = LayerScores(num_layers=self.L, span=self.span, samples=samples, tokens=self.tokens)
        if "block-influence" in self.methods:
            out.block_influence = one_minus(self.bi)
        if "attn-cosine" in self.methods or "mlp-cosine" in self.methods:
            out.attn_importance, out.mlp_importance = one_minus(self.attn), one_minus(self.mlp)
        if "angular" in self.methods:
            out.angular_spans = {n: span_distances(self.last_states, n) for n in range(1, self.L)}
            out.angular = out.angular_spans[self.span]
        if "angular-all" in self.methods:
            out.angular_all = [s / max(c, 1) for s, c in self.all_tokens]
        return out


def _num_layers(model: nn.Module) -> int:
    return len(arch_for(model).layers_of(model))


def check_span(span: int, num_layers: int) -> None:
    if span < 1 or span >= num_layers:
        raise LayercutError(
            f"span {span} does not fit a {num_layers}-layer model: need 1 <= span <= {num_layers - 1} "
            f"(a span of n blocks starts at l = 0..L−n and must end before the last block's output)"
        )


@torch.no_grad()
def compute_scores(
    model: nn.Module,
    calib: CalibSet,
    span: int = 1,
    methods: Sequence[str] = DATA_METHODS,
    batch_size: int = 8,
    progress: bool = True,
) -> LayerScores:
    """Every requested data-driven score in one ``run_blocks`` pass.

    ``methods`` ⊆ {angular, angular-all, block-influence, attn-cosine, mlp-cosine}; also
    accepts ``gate-norm`` (from the in-memory weights) and ``swap-kl`` (extra full-model
    forwards on the first 4 calibration sequences). ``span`` = n of the angular d(l, n).
    """
    methods = list(dict.fromkeys(methods))
    allowed = DATA_METHODS + ("gate-norm", "swap-kl")
    unknown = [m for m in methods if m not in allowed]
    if unknown or not methods:
        raise LayercutError(f"unknown score method {unknown or methods} (choose from {', '.join(allowed)})")
    num_layers = _num_layers(model)
    check_span(span, num_layers)
    data = [m for m in methods if m in DATA_METHODS]
    scores = LayerScores(num_layers=num_layers, span=span)
    if data:
        collector = ScoreCollector(num_layers, span, data)
        run_blocks(model, calib, [collector], batch_size=batch_size, progress=progress, desc="score")
        scores = collector.result(calib.num_samples)
    if "gate-norm" in methods:
        scores.gate_norm = gate_norm_from_model(model)
    if "swap-kl" in methods:
        scores.swap_kl = swap_kl_scores(model, calib, progress=progress)
    scores.meta["methods"] = methods
    return scores


def check_count(n: int, total: int, what: str) -> None:
    if n < 1 or n >= total:
        raise LayercutError(f"cannot drop {n} {what} of {total}: need 1 <= n <= {total - 1}")


def select_blocks(scores: LayerScores, n: int, method: str) -> list[int]:
    """Block indices to drop, ascending.

    ``angular`` / ``angular-all``: the contiguous span l*..l*+n−1, l* = argmin_l d(l, n).
    The last-token table holds every n; ``angular-all`` needs scores computed with span=n.
    ``block-influence``: the n lowest BI, any positions.
    """
    check_count(n, scores.num_layers, "blocks")
    if method == "angular":
        table = (scores.angular_spans or {}).get(n)
        if table is None and scores.span == n:
            table = scores.angular
        if table is None:
            raise LayercutError(f"no angular distances for span {n}: compute scores with methods angular, span={n}")
        return best_span(table, n)
    if method == "angular-all":
        if scores.angular_all is None or scores.span != n:
            raise LayercutError(
                f"angular-all selection of {n} blocks needs scores computed with span={n} "
                f"(these have span={scores.span}{'' if scores.angular_all is not None else ', no angular-all'})"
            )
        return best_span(scores.angular_all, n)
    if method == "block-influence":
        if scores.block_influence is None:
            raise LayercutError("no block-influence scores: compute scores with method block-influence")
        return lowest(scores.block_influence, n)
    raise LayercutError(f"unknown block selection method '{method}' (choose from {', '.join(BLOCK_METHODS)})")


def select_sublayers(
    scores_or_model: LayerScores | nn.Module | str | Path, n: int, method: str, what: str = "attention"
) -> list[int] | list[tuple[int, str]]:
    """Sublayers to drop, lowest importance first removed.

    ``attn-cosine`` / ``mlp-cosine`` (or ``cosine``, picked by ``what``): the n lowest
    LLM-Drop importances, returned as ascending layer indices.
    ``gate-norm`` (attention only): the n lowest G; ``scores_or_model`` may be a checkpoint
    directory (data-free), an in-memory model or LayerScores with ``gate_norm``.
    ``joint``: attention and MLP importances ranked together; returns ``[(layer,
    "attention"|"mlp"), ...]`` sorted by layer (``what`` is ignored).
    """
    if what not in ("attention", "mlp"):
        raise LayercutError(f"unknown sublayer kind '{what}' (attention or mlp)")
    if method not in SUBLAYER_METHODS:
        raise LayercutError(f"unknown sublayer selection method '{method}' (choose from {', '.join(SUBLAYER_METHODS)})")
    if method == "gate-norm":
        if what != "attention":
            raise LayercutError("gate-norm scores attention layers only (use --what attention)")
        gate = _gate_norm_of(scores_or_model)
        check_count(n, len(gate), "attention layers")
        return lowest(gate, n)
    if not isinstance(scores_or_model, LayerScores):
        raise LayercutError(f"method {method} needs LayerScores from compute_scores")
    scores = scores_or_model
    if scores.attn_importance is None or scores.mlp_importance is None:
        raise LayercutError("no sublayer cosine scores: compute scores with attn-cosine / mlp-cosine")
    if method == "joint":
        check_count(n, 2 * scores.num_layers, "sublayers")
        pool = [(s, i, "attention") for i, s in enumerate(scores.attn_importance)]
        pool += [(s, i, "mlp") for i, s in enumerate(scores.mlp_importance)]
        chosen = sorted(pool, key=lambda t: (t[0], t[1], t[2]))[:n]
        return sorted(((i, kind) for _, i, kind in chosen), key=lambda t: (t[0], t[1] != "attention"))
    kind = {"attn-cosine": "attention", "mlp-cosine": "mlp", "cosine": what}[method]
    if kind != what:
        raise LayercutError(f"method {method} scores {kind} sublayers, not {what}")
    check_count(n, scores.num_layers, f"{kind} sublayers")
    return lowest(scores.attn_importance if kind == "attention" else scores.mlp_importance, n)


def _gate_norm_of(source: LayerScores | nn.Module | str | Path) -> list[float]:
    if isinstance(source, LayerScores):
        if source.gate_norm is None:
            raise LayercutError("no gate-norm scores: compute them with method gate-norm")
        return source.gate_norm
    if isinstance(source, nn.Module):
        return gate_norm_from_model(source)
    return gate_norm_scores(source)


def rankings(scores: LayerScores) -> dict[str, list[int]]:
    """Per method, every index ordered least important first."""
    out = {}
    for name in ("block_influence", "attn_importance", "mlp_importance", "angular", "angular_all", "gate_norm"):
        values = getattr(scores, name)
        if values is not None:
            out[name] = ranking(values)
    return out
