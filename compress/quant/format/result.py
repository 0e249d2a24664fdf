"""The GPTQ format's result types, torch-free at import: the supported widths, one quantized
linear (its packed tensors and what the solve reported) and a whole model's result.

The solver (:mod:`layercut.compress.quant.solve.driver`) produces them; the checkpoint writer, the
loader, the allocator and the reports read them. Nothing here imports the solver or a stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 8)  # widths the packer, the kernels and the loaders handle


class SolveSettings(Protocol):
    """What the format reads of the settings a result was solved with (``quantization_config``'s
    desc_act, sym, true_sequential, damp_percent, static_groups and meta); the solver's
    settings object has these fields, and the format does not name it."""

    sym: bool
    act_order: bool
    static_groups: bool
    sequential: str
    damp: float
    method: str


@dataclass
class QuantizedLinear:
    """One quantized linear: packed GPTQ v1 tensors (CPU) and what the solve reported."""

    name: str  # full module name, e.g. model.layers.3.self_attn.q_proj
    bits: int
    group_size: int
    in_features: int
    out_features: int
    tensors: dict[str, Tensor]  # qweight, qzeros, scales (fp16), g_idx (see layercut.compress.quant.format.pack)
    loss: float  # ½ tr(ΔW H ΔWᵀ), the layer's output error on calibration inputs (NaN for RTN)
    damp_used: float
    stored_bits: int = 0  # bits of qweight, qzeros and scales (kept when a streamed run frees the tensors)


@dataclass
class QuantizeResult:
    """All quantized linears of a model, in forward order, plus timings."""

    config: SolveSettings  # the solver's settings (only these fields are read here)
    layers: dict[str, QuantizedLinear] = field(default_factory=dict)
    seconds: float = 0.0
    solve_seconds: float = 0.0  # time inside gptq_quantize / rtn_quantize
    tokens: int = 0  # calibration tokens (non-pad) per Hessian
    head: str | None = None  # module name of the output head when it is quantized too (in ``layers``)
    tune_reports: dict = field(default_factory=dict)  # block index -> block_tune.TuneReport (block tuning only)

    def body(self) -> dict[str, QuantizedLinear]:
        """The decoder blocks' quantized linears (``layers`` without the head)."""
        return {n: q for n, q in self.layers.items() if n != self.head}

    def bits(self) -> dict[str, int]:
        return {n: q.bits for n, q in self.layers.items()}

    def configs(self) -> dict[str, tuple[int, int]]:
        """(bits, group size) per quantized linear; group size -1 = one group per row."""
        return {n: (q.bits, q.group_size) for n, q in self.layers.items()}

    def avg_bits(self) -> float:
        """Stored bits per quantized weight of the decoder blocks (the head, if quantized, is
        reported on its own), scales (fp16) and packed zeros included."""
        body = self.body().values()
        total = sum(q.in_features * q.out_features for q in body)
        return sum(q.stored_bits for q in body) / total


# ----------------------------------------------------------------------- targets
