"""``torch.ops.layercut.gptq_matmul``: y = x @ W^T for a GPTQ v1 weight, plus a kernel registry.

Usage::

    import compress.kernels.ops  # registers the op (touches no CUDA)
    y = torch.ops.layercut.gptq_matmul(x, qweight, qzeros, scales, g_idx, 4, 128)

Implementations (torchao style, one op schema for all):

* a pure-torch reference (CPU and any device; tests compare everything against it):
  dequantize to fp32, matmul in fp32, cast to x's dtype;
* a fake (meta) implementation giving only the output shape, for torch.compile / export;
* CUDA: the GEMV kernel in csrc/ for batch 1..16, the dequantize kernel + cuBLAS matmul for
  larger batches, the reference for anything the kernels do not declare support for.
  ``LAYERCUT_KERNELS=reference`` forces the reference on GPU (debugging, no nvcc).

``group_size`` tells the kernels how g_idx maps inputs to groups: > 0 when
``g_idx[i] == i // group_size``, -1 for one group, 0 when g_idx is an arbitrary (act-order)
map that must be read per input. The reference always reads g_idx, so it is the same maths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from compress.quant.pack import dequantize_gptq

ACT_ORDER = 0  # group_size value meaning "read g_idx per input"


@dataclass(frozen=True)
class KernelSpec:
    """What one kernel handles; ``supports`` lets a layer pick a kernel per layer."""

    name: str
    devices: tuple[str, ...]
    bits: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    min_batch: int = 1
    max_batch: int | None = None  # None: any
    group_multiple: int = 1  # static group sizes must be multiples of this (-1 always ok)
    act_order: bool = True
    in_multiple: int = 1
    out_multiple: int = 1

    def supports(
        self,
        bits: int,
        group_size: int,
        device: str | torch.device,
        batch: int,
        in_features: int | None = None,
        out_features: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> bool:
        """Whether this kernel runs ``bits``/``group_size`` (op convention) on ``device`` at ``batch``."""
        dev = torch.device(device).type
        if dev not in self.devices and "any" not in self.devices:
            return False
        if bits not in self.bits or batch < self.min_batch:
            return False
        if self.max_batch is not None and batch > self.max_batch:
            return False
        if dtype is not None and dtype not in self.dtypes:
            return False
        if group_size == ACT_ORDER and not self.act_order:
            return False
        if group_size > 0 and group_size % self.group_multiple:
            return False
        if in_features is not None and in_features % self.in_multiple:
            return False
        return out_features is None or out_features % self.out_multiple == 0


_HALF = (torch.float16, torch.bfloat16)
CUDA_GEMV = KernelSpec(
    "cuda_gemv",
    ("cuda",),
    (2, 3, 4, 8),
    _HALF,
    max_batch=16,
    group_multiple=32,
    in_multiple=32,
    out_multiple=4,
)
CUDA_DEQUANT_MATMUL = KernelSpec(
    "cuda_dequant_matmul", ("cuda",), (2, 3, 4, 8), _HALF, min_batch=17, in_multiple=32
)
REFERENCE = KernelSpec("reference", ("any",), (2, 3, 4, 8), (torch.float16, torch.bfloat16, torch.float32))
KERNELS: tuple[KernelSpec, ...] = (CUDA_GEMV, CUDA_DEQUANT_MATMUL, REFERENCE)  # in order of preference


def select_kernel(
    bits: int,
    group_size: int,
    device: str | torch.device,
    batch: int,
    in_features: int | None = None,
    out_features: int | None = None,
    dtype: torch.dtype | None = None,
) -> KernelSpec:
    """The first kernel in :data:`KERNELS` that supports the call (the reference always does)."""
    if os.environ.get("LAYERCUT_KERNELS", "").lower() == "reference":
        return REFERENCE
    for spec in KERNELS:
        if spec.supports(bits, group_size, device, batch, in_features, out_features, dtype):
            return spec
    return REFERENCE


def supports(bits: int, group_size: int, device: str | torch.device, batch: int) -> bool:
    """Whether a compiled (non-reference) kernel covers this call."""
    return any(s.supports(bits, group_size, device, batch) for s in KERNELS if s is not REFERENCE)


def reference_gptq_matmul(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int
) -> Tensor:
    """Pure-torch y [..., out] = x [..., in] @ W^T, W dequantized in fp32, fp32 accumulation."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits)  # [out, in] fp32
    return (x.to(torch.float32) @ w.T).to(x.dtype)


def _check_shapes(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int
) -> None:
    in_features, out_features = g_idx.shape[0], qweight.shape[1]
    torch._check(
        x.shape[-1] == in_features, lambda: f"x has {x.shape[-1]} features, g_idx says {in_features}"
    )
    torch._check(qweight.shape[0] == (in_features * bits + 31) // 32, lambda: "qweight rows != in*bits/32")
    torch._check(scales.shape[-1] == out_features, lambda: "scales columns != out_features")
    torch._check(qzeros.shape[0] == scales.shape[0], lambda: "qzeros and scales disagree on groups")


def _aligned(t: Tensor, alignment: int = 16) -> Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % alignment == 0 else t.clone()


@torch.library.custom_op("layercut::gptq_matmul", mutates_args=())
def gptq_matmul(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> Tensor:
    """y [..., out] = x [..., in] @ W^T for GPTQ v1 tensors.

    x: [..., in] fp16/bf16/fp32; qweight: [in*bits/32, out] int32; qzeros: [groups, out*bits/32]
    int32 (zero-1); scales: [groups, out] fp16; g_idx: [in] int32. Output has x's dtype.
    """
    _check_shapes(x, qweight, qzeros, scales, g_idx, bits)
    return reference_gptq_matmul(x, qweight, qzeros, scales, g_idx, bits)


@gptq_matmul.register_fake
def _gptq_matmul_fake(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> Tensor:
    _check_shapes(x, qweight, qzeros, scales, g_idx, bits)
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


@gptq_matmul.register_kernel("cuda")
def _gptq_matmul_cuda(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> Tensor:
    _check_shapes(x, qweight, qzeros, scales, g_idx, bits)
    in_features, out_features = g_idx.shape[0], qweight.shape[1]
    x2 = x.reshape(-1, in_features)  # x2: [batch, in]
    batch = x2.shape[0]
    spec = select_kernel(bits, group_size, x.device, batch, in_features, out_features, x.dtype)
    if spec is REFERENCE or batch == 0:
        return reference_gptq_matmul(x, qweight, qzeros, scales, g_idx, bits)
    from compress.kernels.build import load_library  # first use builds/loads the library

    lib = load_library()
    # the kernels read int32 words, fp16 scales and int32 g_idx (the checkpoint dtypes), with
    # 128-bit loads of qweight and 64-bit loads of scales: views at odd offsets are copied
    tensors = [
        _aligned(qweight.to(torch.int32)),
        qzeros.to(torch.int32).contiguous(),
        _aligned(scales.to(torch.float16)),
        g_idx.to(torch.int32).contiguous(),
    ]
    if spec is CUDA_GEMV:
        y = lib.gemv(x2.contiguous(), *tensors, bits, group_size)
    else:
        w_t = lib.dequantize_t(*tensors, bits, x.dtype)  # [in, out]
        y = x2 @ w_t  # cuBLAS, fp32 accumulation
    return y.reshape(*x.shape[:-1], out_features)
