"""QuantLinear: a GPTQ v1 linear layer whose state dict is the checkpoint's tensors.

Usage::

    from layercut.compress.quant.format.qlinear import QuantLinear
    ql = QuantLinear.from_dense(linear, q, zeros, scales, g_idx, bits=4, group_size=128)
    y = ql(x)                        # torch.ops.layercut.gptq_matmul (kernel chosen per call, see
                                     # layercut.compress.kernels.ops: CUDA C / Triton on GPU, reference on CPU)
    ql.state_dict().keys()           # qweight, qzeros, scales, g_idx[, bias] -- GPTQ safetensors names

An empty layer (``QuantLinear(in_features, out_features, bits, group_size, bias=...)``) has
buffers of the checkpoint's shapes, so ``load_state_dict`` from GPTQ safetensors works
directly (also from the meta device with ``assign=True``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from layercut.compress.core.errors import LayercutError
from layercut.compress.kernels import ops  # registers torch.ops.layercut.gptq_matmul
from layercut.compress.kernels.ops import ACT_ORDER
from layercut.compress.quant.format.pack import dequantize_gptq, pack_gptq, packed_rows
from layercut.compress.quant.format.result import SUPPORTED_BITS


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W stored in GPTQ v1 packing.

    Buffers: qweight [in*bits/32, out] int32, qzeros [groups, out*bits/32] int32 (zero-1),
    scales [groups, out] fp16, g_idx [in] int32, bias [out] fp16 (optional).
    ``cache_dequantized=True`` keeps the fp32 weight after the first CPU forward (faster on
    CPU at 4-8x the memory); GPU forwards always run the packed kernels, and so do CPU
    forwards under ``TRITON_INTERPRET=1`` or a forced ``LAYERCUT_KERNELS=triton|cuda`` (the op
    then runs, or refuses, the kernel asked for).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int = 128,
        bias: bool = False,
        device: torch.device | str | None = None,
        cache_dequantized: bool = False,
    ):
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise LayercutError(f"QuantLinear supports bits in {SUPPORTED_BITS}, got {bits}")
        if group_size != -1 and group_size <= 0:
            raise LayercutError(f"group_size must be -1 or positive, got {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.cache_dequantized = cache_dequantized
        gs = in_features if group_size == -1 else group_size
        groups = (in_features + gs - 1) // gs
        self.register_buffer(
            "qweight",
            torch.zeros(packed_rows(in_features, bits), out_features, dtype=torch.int32, device=device),
        )
        self.register_buffer(
            "qzeros", torch.zeros(groups, packed_rows(out_features, bits), dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", (torch.arange(in_features, device=device) // gs).to(torch.int32))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, device=device))
        else:
            self.bias = None
        self._layout_key: tuple | None = None  # g_idx identity the op group_size was computed for
        self._op_group_size = group_size
        self._cache_key: tuple | None = None
        self._cached_weight: Tensor | None = None

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        q: Tensor,
        zeros: Tensor,
        scales: Tensor,
        g_idx: Tensor,
        bits: int,
        group_size: int,
        cache_dequantized: bool = False,
    ) -> QuantLinear:
        """Build from GPTQ output for ``linear``: q [out, in], zeros/scales [groups, out], g_idx [in].

        Only the bias (and device) of ``linear`` is used; its weight is replaced by the codes.
        """
        out_features, in_features = linear.weight.shape
        if q.shape != (out_features, in_features):
            raise LayercutError(
                f"codes {tuple(q.shape)} do not match the linear layer {(out_features, in_features)}"
            )
        packed = pack_gptq(q, zeros, scales, g_idx, bits)
        layer = cls(
            in_features,
            out_features,
            bits,
            group_size,
            bias=linear.bias is not None,
            device="meta",
            cache_dequantized=cache_dequantized,
        )
        device = linear.weight.device
        state = {k: v.to(device) for k, v in packed.items()}
        if linear.bias is not None:
            state["bias"] = linear.bias.detach().to(device=device, dtype=torch.float16)
        # assign=True: the buffers take the packed tensors' shapes (act-order may add groups)
        layer.load_state_dict(state, assign=True)
        return layer

    def _kernel_group_size(self) -> int:
        """group_size in the op's convention: static size if g_idx[i] == i // gs, else ACT_ORDER."""
        g = self.g_idx
        key = (g.data_ptr(), g._version, g.device, self.scales.shape[0])
        if key != self._layout_key:
            gs = self.in_features if self.group_size == -1 else self.group_size
            static = torch.arange(self.in_features, device=g.device, dtype=torch.int32) // gs
            if torch.equal(g.to(torch.int32), static):
                self._op_group_size = -1 if self.group_size == -1 or gs >= self.in_features else gs
            else:
                self._op_group_size = ACT_ORDER
            self._layout_key = key
        return self._op_group_size

    def dequantize(self) -> Tensor:
        """W [out, in] float32."""
        return dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits)

    def _dequantized_cached(self) -> Tensor:
        key = tuple(
            (b.data_ptr(), b._version, b.device) for b in (self.qweight, self.qzeros, self.scales, self.g_idx)
        )
        if key != self._cache_key:
            self._cached_weight = self.dequantize()
            self._cache_key = key
        return self._cached_weight

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> y [..., out] in x's dtype (fp32 accumulation)."""
        cpu_reference = ops.kernel_mode() in ("auto", "reference") and not ops.triton_interpret()
        if self.cache_dequantized and x.device.type == "cpu" and cpu_reference:
            y = (x.to(torch.float32) @ self._dequantized_cached().T).to(x.dtype)
        else:
            y = torch.ops.layercut.gptq_matmul(
                x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self._kernel_group_size()
            )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )
