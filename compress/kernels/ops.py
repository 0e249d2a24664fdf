"""``torch.ops.layercut.gptq_matmul``: y = x @ W^T for a GPTQ v1 weight, plus a kernel registry.

Usage::

    import layercut.compress.kernels.ops  # registers the op (imports neither triton nor CUDA)
    y = torch.ops.layercut.gptq_matmul(x, qweight, qzeros, scales, g_idx, 4, 128)
    ops.last_kernel()            # "cuda_gemv" | "triton" | "cuda_dequant_matmul" | "reference"

Implementations (torchao style, one op schema for all), in order of preference:

* ``cuda_gemv``: the CUDA C GEMV in csrc/ (batch 1..16, fp16/bf16, group sizes a multiple of 32,
  in % 32 == 0, out % 4 == 0), when the library can be loaded (nvcc or $LAYERCUT_KERNEL_LIB);
* ``triton``: the Triton kernels in triton_gptq.py (any batch, any shape, fp16/bf16/fp32), when
  triton is installed;
* ``cuda_dequant_matmul``: the CUDA C dequantize kernel + cuBLAS (batch > 16);
* ``reference``: pure torch (CPU and any device; the tests compare everything against it):
  dequantize to fp32, matmul in fp32, cast to x's dtype;
* a fake (meta) implementation giving only the output shape, for torch.compile / export.

Routing. ``LAYERCUT_KERNELS`` = ``reference`` | ``triton`` | ``cuda`` forces one family (a forced
kernel that cannot run the call is an error, never a silent fallback); unset (or ``auto``) picks
the first of the list above whose ``KernelSpec.supports`` covers the call. CPU tensors run the
reference, except under ``TRITON_INTERPRET=1`` (with triton installed): then they run the Triton
kernels in Triton's interpreter. That is how CI checks the Triton kernels without a GPU; it is
slow (about 1 s per call at 576 x 1536 on a busy 2-core CPU), so it is for verification only. ``last_kernel()`` and
``kernel_calls()`` say which implementation ran, so a test can prove the kernel it meant ran.

``group_size`` tells the kernels how g_idx maps inputs to groups: > 0 when
``g_idx[i] == i // group_size``, -1 for one group, 0 when g_idx is an arbitrary (act-order)
map that must be read per input. The reference always reads g_idx, so it is the same maths.
Every call is validated (bits, dtypes, the packed shapes against in/out, g_idx length, the
number of groups) and a bad one raises LayercutError naming the tensor.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from layercut.compress.core.errors import LayercutError
from layercut.compress.kernels import build  # nvcc lookup, the library's first-use build
from layercut.compress.quant.format.pack import dequantize_gptq, packed_rows
from layercut.compress.quant.format.result import SUPPORTED_BITS

ACT_ORDER = 0  # group_size value meaning "read g_idx per input"
MODES = ("reference", "triton", "cuda")  # values of $LAYERCUT_KERNELS (besides unset / "auto")
_TRUE = ("1", "true", "on", "yes")  # how triton reads TRITON_INTERPRET


def triton_interpret() -> bool:
    """Whether TRITON_INTERPRET is on (read per call, as triton itself does)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_available() -> bool:
    """Whether triton is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _cuda_library_available() -> bool:
    """Whether the CUDA C library can be loaded or built here (no build, no CUDA touched)."""
    if os.environ.get("LAYERCUT_KERNEL_LIB"):
        return True
    return build.find_nvcc() is not None


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
    family: str = "reference"  # the $LAYERCUT_KERNELS value that forces it
    cpu_when_interpreting: bool = False  # also CPU tensors under TRITON_INTERPRET=1

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
        return self.why_not(bits, group_size, device, batch, in_features, out_features, dtype) is None

    def why_not(
        self,
        bits: int,
        group_size: int,
        device: str | torch.device,
        batch: int,
        in_features: int | None = None,
        out_features: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> str | None:
        """None if supported, else the first reason it is not (for error messages)."""
        dev = torch.device(device).type
        on_device = dev in self.devices or "any" in self.devices
        if not on_device and not (dev == "cpu" and self.cpu_when_interpreting and triton_interpret()):
            extra = " (CPU tensors need TRITON_INTERPRET=1)" if self.cpu_when_interpreting else ""
            return f"runs on {'/'.join(self.devices)} tensors, not {dev}{extra}"
        if bits not in self.bits:
            return f"takes bits {self.bits}, not {bits}"
        if batch < self.min_batch or (self.max_batch is not None and batch > self.max_batch):
            return f"takes batch {self.min_batch}..{self.max_batch or 'any'}, not {batch}"
        if dtype is not None and dtype not in self.dtypes:
            return f"takes {[str(d).removeprefix('torch.') for d in self.dtypes]} inputs, not {dtype}"
        if group_size == ACT_ORDER and not self.act_order:
            return "does not take act-order g_idx"
        if group_size > 0 and group_size % self.group_multiple:
            return f"needs group sizes that are multiples of {self.group_multiple}, not {group_size}"
        if in_features is not None and in_features % self.in_multiple:
            return f"needs in_features % {self.in_multiple} == 0, not {in_features}"
        if out_features is not None and out_features % self.out_multiple:
            return f"needs out_features % {self.out_multiple} == 0, not {out_features}"
        return None

    def available(self) -> bool:
        """Whether what it needs is installed (triton / the CUDA C library); never imports or builds."""
        if self.family == "triton":
            return triton_available()
        if self.family == "cuda":
            return _cuda_library_available()
        return True


_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
CUDA_GEMV = KernelSpec(
    "cuda_gemv",
    ("cuda",),
    (2, 3, 4, 8),
    _HALF,
    max_batch=16,
    group_multiple=32,
    in_multiple=32,
    out_multiple=4,
    family="cuda",
)
TRITON = KernelSpec("triton", ("cuda",), (2, 3, 4, 8), _FLOATS, family="triton", cpu_when_interpreting=True)
CUDA_DEQUANT_MATMUL = KernelSpec(
    "cuda_dequant_matmul", ("cuda",), (2, 3, 4, 8), _HALF, min_batch=17, in_multiple=32, family="cuda"
)
REFERENCE = KernelSpec("reference", ("any",), (2, 3, 4, 8), _FLOATS)
# in order of preference
KERNELS: tuple[KernelSpec, ...] = (CUDA_GEMV, TRITON, CUDA_DEQUANT_MATMUL, REFERENCE)


def kernel_mode() -> str:
    """$LAYERCUT_KERNELS: "auto" (unset) or one of :data:`MODES`."""
    mode = os.environ.get("LAYERCUT_KERNELS", "").strip().lower() or "auto"
    if mode != "auto" and mode not in MODES:
        raise LayercutError(f"LAYERCUT_KERNELS={mode!r}: expected one of {', '.join(MODES)} (or unset)")
    return mode


def select_kernel(
    bits: int,
    group_size: int,
    device: str | torch.device,
    batch: int,
    in_features: int | None = None,
    out_features: int | None = None,
    dtype: torch.dtype | None = None,
) -> KernelSpec:
    """The kernel a call runs: the first available one that supports it, or the forced family's.

    Raises LayercutError when $LAYERCUT_KERNELS forces a family that cannot run this call.
    """
    mode = kernel_mode()
    if mode == "reference":
        return REFERENCE
    call = (bits, group_size, device, batch, in_features, out_features, dtype)
    if mode == "auto":
        for spec in KERNELS:
            if spec.supports(*call) and spec.available():
                return spec
        return REFERENCE
    family = [s for s in KERNELS if s.family == mode]
    for spec in family:
        if spec.supports(*call):
            if not spec.available():
                raise LayercutError(_unavailable(spec))
            return spec
    reasons = "; ".join(f"{s.name} {s.why_not(*call)}" for s in family)
    raise LayercutError(f"LAYERCUT_KERNELS={mode} cannot run this call: {reasons}")


def _unavailable(spec: KernelSpec) -> str:
    if spec.family == "triton":
        return "LAYERCUT_KERNELS=triton but triton is not installed: pip install triton"
    return (
        "LAYERCUT_KERNELS=cuda but the CUDA C library cannot be built or loaded: install nvcc "
        "or set LAYERCUT_KERNEL_LIB"
    )


def supports(bits: int, group_size: int, device: str | torch.device, batch: int) -> bool:
    """Whether a non-reference kernel that is installed here covers this call."""
    return any(
        s.supports(bits, group_size, device, batch) and s.available() for s in KERNELS if s is not REFERENCE
    )


# ---------------------------------------------------------------- which kernel ran

_CALLS: Counter[str] = Counter()
_LAST: list[str | None] = [None]


def last_kernel() -> str | None:
    """Name of the implementation the latest eager call of the op ran (None before any)."""
    return _LAST[0]


def kernel_calls() -> dict[str, int]:
    """Eager calls of the op per implementation name since the last reset."""
    return dict(_CALLS)


def reset_kernel_calls() -> None:
    _CALLS.clear()
    _LAST[0] = None


def _record(name: str) -> None:
    _CALLS[name] += 1
    _LAST[0] = name


# ---------------------------------------------------------------- Triton module (lazy)

_TRITON_MODULES: dict[bool, ModuleType] = {}
_LOCK = threading.Lock()


def triton_module() -> ModuleType:
    """triton_gptq.py loaded for the current TRITON_INTERPRET mode (imports triton on first use).

    ``@triton.jit`` decides at decoration time whether kernels compile or interpret, so the file
    is loaded once per mode, as its own module, and both copies can coexist in one process.
    """
    interpret = triton_interpret()
    with _LOCK:
        mod = _TRITON_MODULES.get(interpret)
        if mod is None:
            if not triton_available():
                raise LayercutError(_unavailable(TRITON))
            name = "layercut.compress.kernels.triton_gptq" + ("_interpreted" if interpret else "")
            spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("triton_gptq.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclasses and inspect look the module up by name
            spec.loader.exec_module(mod)
            if mod.INTERPRET != interpret:
                raise LayercutError("triton disagrees with TRITON_INTERPRET; set it before the first call")
            _TRITON_MODULES[interpret] = mod
        return mod


# ---------------------------------------------------------------- validation and maths


def reference_gptq_matmul(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int
) -> Tensor:
    """Pure-torch y [..., out] = x [..., in] @ W^T, W dequantized in fp32, fp32 accumulation."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits)  # [out, in] fp32
    return (x.to(torch.float32) @ w.T).to(x.dtype)


_INTS = (torch.int32, torch.int64)


def check_args(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> None:
    """Raise LayercutError unless the call is a well-formed GPTQ v1 matmul (shapes, dtypes, bits)."""

    def bad(msg: str) -> None:
        raise LayercutError(f"gptq_matmul: {msg}")

    if bits not in SUPPORTED_BITS:
        bad(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if x.dtype not in _FLOATS:
        bad(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    for name, t, ok in (
        ("qweight", qweight, (torch.int32,)),
        ("qzeros", qzeros, (torch.int32,)),
        ("scales", scales, _FLOATS),
        ("g_idx", g_idx, _INTS),
    ):
        if t.dtype not in ok:
            bad(f"{name} must be {' or '.join(str(d).removeprefix('torch.') for d in ok)}, got {t.dtype}")
        if t.dim() != (1 if name == "g_idx" else 2):
            bad(f"{name} must have {1 if name == 'g_idx' else 2} dimensions, got shape {tuple(t.shape)}")
        if t.device != x.device:
            bad(f"{name} is on {t.device}, x on {x.device}")
    if x.dim() == 0:
        bad("x must have at least one dimension")
    in_features, out_features = x.shape[-1], qweight.shape[1]
    if g_idx.shape[0] != in_features:
        bad(f"g_idx has {g_idx.shape[0]} entries, x has {in_features} features")
    if qweight.shape[0] != packed_rows(in_features, bits):
        bad(
            f"qweight has {qweight.shape[0]} rows; {in_features} inputs at {bits} bits need "
            f"{packed_rows(in_features, bits)}"
        )
    if scales.shape[1] != out_features:
        bad(f"scales has {scales.shape[1]} columns, qweight {out_features}")
    if qzeros.shape[1] != packed_rows(out_features, bits):
        bad(
            f"qzeros has {qzeros.shape[1]} columns; {out_features} outputs at {bits} bits need "
            f"{packed_rows(out_features, bits)}"
        )
    if qzeros.shape[0] != scales.shape[0] or scales.shape[0] < 1:
        bad(f"qzeros ({qzeros.shape[0]}) and scales ({scales.shape[0]}) disagree on the number of groups")
    if group_size < -1:
        bad(f"group_size must be -1, 0 (act-order) or positive, got {group_size}")
    if group_size > 0 and scales.shape[0] < -(-in_features // group_size):
        bad(f"{in_features} inputs in groups of {group_size} need {-(-in_features // group_size)} scale rows")


def _check_g_idx_values(g_idx: Tensor, group_size: int, groups: int, in_features: int) -> None:
    """CPU only (a GPU check would synchronise): g_idx in range and matching a static group_size."""
    if g_idx.device.type != "cpu" or in_features == 0:
        return
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise LayercutError(f"gptq_matmul: g_idx values must lie in [0, {groups})")
    if group_size != ACT_ORDER:
        gs = in_features if group_size == -1 else group_size
        if not torch.equal(g_idx.to(torch.int64), torch.arange(in_features) // gs):
            raise LayercutError(
                f"gptq_matmul: group_size={group_size} but g_idx is not i // {gs}; pass 0 (act-order)"
            )


def _run(
    spec: KernelSpec, x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int,
    group_size: int,
) -> Tensor:  # fmt: skip
    """Run ``spec`` on validated arguments; x [..., in] -> y [..., out] in x's dtype."""
    in_features, out_features = g_idx.shape[0], qweight.shape[1]
    x2 = x.reshape(-1, in_features)  # x2: [batch, in]
    _record(spec.name)
    if spec is REFERENCE:
        return reference_gptq_matmul(x, qweight, qzeros, scales, g_idx, bits)
    if spec is TRITON:
        y = triton_module().gptq_matmul(x2, qweight, qzeros, scales, g_idx, bits, group_size)
        return y.reshape(*x.shape[:-1], out_features)
    lib = build.load_library()  # first use builds/loads the library
    # the kernels read int32 words, fp16 scales and int32 g_idx (the checkpoint dtypes), with
    # 128-bit loads of qweight and 64-bit loads of scales: views at odd offsets are copied
    tensors = [
        _aligned(qweight),
        qzeros.contiguous(),
        _aligned(scales.to(torch.float16)),
        g_idx.to(torch.int32).contiguous(),
    ]
    if spec is CUDA_GEMV:
        y = lib.gemv(x2.contiguous(), *tensors, bits, group_size)
    else:
        w_t = lib.dequantize_t(*tensors, bits, x.dtype)  # [in, out]
        y = x2 @ w_t  # cuBLAS, fp32 accumulation
    return y.reshape(*x.shape[:-1], out_features)


def _aligned(t: Tensor, alignment: int = 16) -> Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % alignment == 0 else t.clone()


@torch.library.custom_op("layercut::gptq_matmul", mutates_args=())
def gptq_matmul(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> Tensor:
    """y [..., out] = x [..., in] @ W^T for GPTQ v1 tensors (this body serves CPU tensors).

    x: [..., in] fp16/bf16/fp32; qweight: [in*bits/32, out] int32; qzeros: [groups, out*bits/32]
    int32 (zero-1); scales: [groups, out] fp16 (bf16/fp32 accepted); g_idx: [in] int32/int64.
    Output has x's dtype.
    """
    check_args(x, qweight, qzeros, scales, g_idx, bits, group_size)
    in_features, out_features = g_idx.shape[0], qweight.shape[1]
    batch = x.numel() // max(in_features, 1)
    spec = select_kernel(bits, group_size, x.device, batch, in_features, out_features, x.dtype)
    _check_g_idx_values(g_idx, group_size if spec is TRITON else ACT_ORDER, scales.shape[0], in_features)
    return _run(spec, x, qweight, qzeros, scales, g_idx, bits, group_size)


@gptq_matmul.register_fake
def _gptq_matmul_fake(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> Tensor:
    check_args(x, qweight, qzeros, scales, g_idx, bits, group_size)
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


@gptq_matmul.register_kernel("cuda")
def _gptq_matmul_cuda(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, group_size: int
) -> Tensor:
    check_args(x, qweight, qzeros, scales, g_idx, bits, group_size)
    in_features, out_features = g_idx.shape[0], qweight.shape[1]
    batch = x.numel() // max(in_features, 1)
    spec = select_kernel(bits, group_size, x.device, batch, in_features, out_features, x.dtype)
    if batch == 0 and spec is not REFERENCE:
        spec = REFERENCE  # nothing to launch
    return _run(spec, x, qweight, qzeros, scales, g_idx, bits, group_size)
