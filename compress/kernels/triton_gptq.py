"""Triton kernels for GPTQ v1 weights: fused dequantize + matmul, split-K for decode.

Usage (normally through the op, which picks this module per call)::

    LAYERCUT_KERNELS=triton python ...                  # GPU: force the Triton kernels
    TRITON_INTERPRET=1 python -m pytest tests/test_triton.py   # CPU: the same kernels, interpreted

    from layercut.compress.kernels import ops
    y = torch.ops.layercut.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, group_size)
    ops.last_kernel()  # "triton"

Do not import this module directly: ``ops.triton_module()`` loads it once per interpreter mode,
because ``@triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET`` is read then, not at launch). Triton's own ``@jit`` library functions
(``tl.zeros``, ``tl.sum``, ...) are decorated once, when triton is imported, in whatever mode was
on then; the kernels here therefore call only builtins and their own helpers, so both module
copies work in one process whatever the mode was at ``import triton``.

Format (see compress/quant/format/pack.py): qweight [ceil(in*bits/32), out] int32 holds each output
column's codes as a little-endian bit stream (code k at bit k*bits; 3-bit codes 10 and 21 of
every 32 straddle two words); qzeros [groups, ceil(out*bits/32)] int32 the zero points the same
way along out, stored as zero-1 (GPTQModel's packed-word offset for 2/4/8 bits, per field mod 8
for 3 bits); scales [groups, out]; g_idx [in].

One kernel, two launch shapes:

* decode (batch <= 16): BLOCK_M = 16 and split-K, so that even 1-row calls put enough programs
  on the GPU; split partials (fp32) are summed by one torch reduction in a fixed order;
* prefill (batch > 16): BLOCK_M 32..128 tiles, no split.

Maths per K tile (fp32 accumulation everywhere):

* static groups (g_idx[k] == k // group_size, group_size a multiple of BLOCK_K, or one group):
  the tile lies in one group g, so ``acc += s_g * (x @ (q - z_g))``, a ``tl.dot`` of x
  (fp16/bf16) with integers in [-255, 255], which fp16 and bf16 hold exactly: no weight rounding;
* act-order, or groups smaller than the tile: the weights are dequantized per element,
  ``w = s[g_idx[k]] * (q - z[g_idx[k]])`` in fp32, then cast to x's dtype for the ``tl.dot``
  (one rounding of w: relative 2^-11 for fp16, 2^-8 for bf16).

fp32 activations use ``tl.dot(..., input_precision="ieee")`` (no TF32). Under the interpreter a
bf16 ``tl.dot`` multiplies bit patterns (triton-lang/triton#11584, "not supported yet"), so bf16
runs its dots in fp32 there; the values are the same (bf16 inputs and integer codes are exact in
fp32), only the GPU's bf16 tensor-core instruction is not exercised.

Autotuning (GPU only): the first call for a (bits, layout, dtype, batch bucket, in, out) key
times every config of its list with CUDA events and keeps the fastest. The lists are short on
purpose (each config is one compile per bits/layout/dtype, seconds each):

* DECODE_CONFIGS (BLOCK_N, BLOCK_K, num_warps, num_stages): narrow-N/long-K tiles stream more
  bytes per program; split-K is then chosen so that about 4 programs run per SM;
* PREFILL_CONFIGS (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the usual square-ish
  tensor-core tiles; BLOCK_K 32/64 keeps g64/g128 tiles on the one-group path.

Under the interpreter, and on a GPU with ``LAYERCUT_TRITON_AUTOTUNE=0`` (the GPU tests: one
compile per case instead of three), the first config runs unless the caller names one; the
tests run every config of both lists, so whichever the GPU picks has been checked.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from layercut.compress.core.errors import LayercutError

_KNOBS = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the environment directly
INTERPRET = (  # fixed when this module was loaded
    bool(_KNOBS.runtime.interpret)
    if _KNOBS is not None
    else os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
)
ONE_GROUP = 1 << 30  # group_size passed for "one group" (-1): k // ONE_GROUP == 0 for any k


@dataclass(frozen=True)
class Config:
    """One tile shape; split_k 0 = chosen from the SM count (decode only)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0


DECODE_CONFIGS: tuple[Config, ...] = (
    Config(16, 64, 128, num_warps=4, num_stages=3),
    Config(16, 128, 64, num_warps=4, num_stages=4),
    Config(16, 32, 128, num_warps=2, num_stages=4),
)
PREFILL_CONFIGS: tuple[Config, ...] = (
    Config(64, 64, 64, num_warps=4, num_stages=3),
    Config(128, 128, 32, num_warps=8, num_stages=3),
    Config(64, 128, 64, num_warps=4, num_stages=4),
)
DECODE_MAX_BATCH = 16


@triton.jit
def _codes(qw_ptr, k0, offs_n, n_mask, N, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Codes [BLOCK_K, BN] (uint32) of inputs k0 .. k0+BLOCK_K (k0 % BLOCK_K == 0) for columns offs_n.

    Each packed word is loaded once (rows of qweight are contiguous along N) and split into its
    fields in registers. Codes past K come from no row (masked to 0) or from the last, partial
    word; the caller zeroes x there, so they never count.
    """
    if BITS == 3:
        # 32 codes fill 3 words; code j of a block starts at bit 3j of the block's 96 bits,
        # codes 10 and 21 straddle two words
        r0 = (k0 // 32) * 3 + tl.arange(0, BLOCK_K // 32) * 3  # first row of each 32-code block
        ptrs = qw_ptr + r0[:, None] * N + offs_n[None, :]
        w0 = tl.load(ptrs, mask=(r0 * 32 < K * 3)[:, None] & n_mask[None, :], other=0)
        w1 = tl.load(ptrs + N, mask=((r0 + 1) * 32 < K * 3)[:, None] & n_mask[None, :], other=0)
        w2 = tl.load(ptrs + 2 * N, mask=((r0 + 2) * 32 < K * 3)[:, None] & n_mask[None, :], other=0)
        w0 = w0.to(tl.uint32, bitcast=True)[:, None, :]  # [BLOCK_K // 32, 1, BN]
        w1 = w1.to(tl.uint32, bitcast=True)[:, None, :]
        w2 = w2.to(tl.uint32, bitcast=True)[:, None, :]
        bit = tl.arange(0, 32) * 3
        word = (bit // 32)[None, :, None]  # [1, 32, 1]
        shift = (bit % 32).to(tl.uint32)[None, :, None]
        lo = tl.where(word == 0, w0, tl.where(word == 1, w1, w2)) >> shift
        hi = tl.where(word == 0, w1, w2) << ((32 - shift) % 32)
        v = lo | tl.where(shift > 29, hi, 0)
        return tl.reshape(v & 7, (BLOCK_K, offs_n.shape[0]))
    else:
        rows = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))  # 32 // BITS codes per word
        w = tl.load(
            qw_ptr + rows[:, None] * N + offs_n[None, :],
            mask=(rows * 32 < K * BITS)[:, None] & n_mask[None, :],
            other=0,
        ).to(tl.uint32, bitcast=True)
        shift = (tl.arange(0, 32 // BITS) * BITS).to(tl.uint32)
        v = (w[:, None, :] >> shift[None, :, None]) & ((1 << BITS) - 1)  # [rows, 32 // BITS, BN]
        return tl.reshape(v, (BLOCK_K, offs_n.shape[0]))  # row-major: code k = row * (32 // BITS) + field


@triton.jit
def _zero_points(row_ptr, offs_n, mask, BITS: tl.constexpr):
    """True zero points (fp32) of columns offs_n from qzeros rows row_ptr (broadcast together)."""
    bit = offs_n * BITS
    shift = (bit % 32).to(tl.uint32)
    ptrs = row_ptr + bit // 32
    w = tl.load(ptrs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    if BITS == 3:
        v = w >> shift
        hi = tl.load(ptrs + 1, mask=mask & (shift > 29), other=0).to(tl.uint32, bitcast=True)
        v = v | (hi << ((32 - shift) % 32))
        z = (v + 1) & 7  # the v1 offset is per field, mod 8
    else:
        # add 1 to every field of the word, carries included: the inverse of GPTQModel's
        # packed-word subtraction (uint32 wraps like its int32 arithmetic)
        if BITS == 2:
            ones = 0x55555555
        elif BITS == 4:
            ones = 0x11111111
        else:
            ones = 0x01010101
        z = ((w + ones) >> shift) & ((1 << BITS) - 1)
    return z.to(tl.float32)


@triton.jit
def gptq_matmul_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, row stride stride_xm, unit column stride
    qw_ptr,  # [ceil(K*BITS/32), N] int32
    qz_ptr,  # [groups, stride_qz] int32 (zero - 1)
    sc_ptr,  # [groups, N] fp16/bf16/fp32
    g_ptr,  # [K] int32/int64 (read only when GROUP_SIZE == 0)
    out_ptr,  # [M, N] (SPLIT == 1, x's dtype) or [splits, M, N] fp32 partials
    M,
    N,
    K,
    stride_xm,
    stride_qz,
    k_per_split,  # a multiple of BLOCK_K
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # > 0 static (ONE_GROUP for one group), 0 act-order (read g_idx)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # dtype of the tl.dot operands
    IEEE: tl.constexpr,  # fp32 operands: input_precision="ieee" (no TF32)
    OUT_BF16: tl.constexpr,  # out_ptr is bf16
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        # x tile [BM, BK] in fp32 (the interpreter cannot do arithmetic on bf16)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        kn_mask = k_mask[:, None] & n_mask[None, :]
        q = _codes(qw_ptr, k0, offs_n, n_mask, N, K, BITS, BLOCK_K)  # [BK, BN] uint32
        if GROUP_SIZE > 0 and GROUP_SIZE % BLOCK_K == 0:
            # the whole tile lies in group g: one scale and zero point per column, and
            # q - z is an integer in [-255, 255], exact in fp16 and bf16: no weight rounding
            g = k0 // GROUP_SIZE
            s = tl.load(sc_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            z = _zero_points(qz_ptr + g * stride_qz, offs_n, n_mask, BITS)  # [BN]
            qz = (q.to(tl.float32) - z[None, :]).to(DOT_DTYPE)  # [BK, BN]
            if IEEE:
                xq = tl.dot(x.to(DOT_DTYPE), qz, input_precision="ieee")
            else:
                xq = tl.dot(x.to(DOT_DTYPE), qz, out_dtype=tl.float32)
            acc += s[None, :] * xq
        else:
            if GROUP_SIZE > 0:
                g = offs_k // GROUP_SIZE  # groups smaller than the tile
            else:
                g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)  # act-order: per input
            s = tl.load(sc_ptr + g[:, None] * N + offs_n[None, :], mask=kn_mask, other=0.0).to(tl.float32)
            z = _zero_points(qz_ptr + g[:, None] * stride_qz, offs_n[None, :], kn_mask, BITS)
            w = (s * (q.to(tl.float32) - z)).to(DOT_DTYPE)  # [BK, BN]; exact in fp32
            if IEEE:
                acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x.to(DOT_DTYPE), w, acc, out_dtype=tl.float32)
    out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    if OUT_BF16:
        # round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates, so
        # this keeps the GPU and the interpreter on the same, checked, rounding
        b = acc.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(acc != acc, 0x7FC0, r)  # NaN stays NaN
        val = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        val = acc.to(out_ptr.dtype.element_ty)
    tl.store(out, val, mask=m_mask[:, None] & n_mask[None, :])


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_SM_COUNT: dict[int, int] = {}
_TUNED: dict[tuple, Config] = {}


def _sm_count(device: torch.device) -> int:
    """SMs of the device (CPU/interpreter: 8, so that split-K > 1 also runs there)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def split_k_for(cfg: Config, batch: int, in_features: int, out_features: int, sm_count: int) -> int:
    """Splits of K for a decode launch: about 4 programs per SM, each split >= 2 K tiles."""
    if cfg.split_k:
        return cfg.split_k
    tiles = math.ceil(batch / cfg.block_m) * math.ceil(out_features / cfg.block_n)
    k_tiles = math.ceil(in_features / cfg.block_k)
    return max(1, min(math.ceil(4 * sm_count / tiles), k_tiles // 2, 16))


def launch_options(cfg: Config, dtype: torch.dtype) -> dict[str, int]:
    """num_warps / num_stages of a launch: fp32 operands take twice the shared memory per stage,
    so they pipeline 2 deep (keeps every config under the 164 KiB of an sm_80 SM)."""
    stages = cfg.num_stages if dtype != torch.float32 else min(cfg.num_stages, 2)
    return {"num_warps": cfg.num_warps, "num_stages": stages}


def _launch(cfg: Config, x2, qweight, qzeros, scales, g_idx, bits: int, group_size: int, out_dtype):
    batch, in_features = x2.shape
    out_features = qweight.shape[1]
    splits = split_k_for(cfg, batch, in_features, out_features, _sm_count(x2.device))
    k_per_split = math.ceil(math.ceil(in_features / splits) / cfg.block_k) * cfg.block_k
    splits = math.ceil(in_features / k_per_split)  # drop empty trailing splits
    if splits == 1:
        out = torch.empty(batch, out_features, dtype=out_dtype, device=x2.device)
    else:
        out = torch.empty(splits, batch, out_features, dtype=torch.float32, device=x2.device)
    dot_dtype = x2.dtype
    if INTERPRET and x2.dtype == torch.bfloat16:
        dot_dtype = torch.float32  # see the module docstring (interpreter bf16 tl.dot)
    grid = (math.ceil(batch / cfg.block_m), math.ceil(out_features / cfg.block_n), splits)
    gptq_matmul_kernel[grid](
        x2, qweight, qzeros, scales, g_idx, out,
        batch, out_features, in_features, x2.stride(0), qzeros.stride(0), k_per_split,
        BITS=bits,
        GROUP_SIZE=ONE_GROUP if group_size == -1 else group_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_DTYPE=_TL_DTYPES[dot_dtype], IEEE=dot_dtype == torch.float32, OUT_BF16=out.dtype == torch.bfloat16,
        **launch_options(cfg, x2.dtype),
    )  # fmt: skip
    if splits == 1:
        return out
    return out.sum(0).to(out_dtype)  # fixed order: deterministic


def configs_for(batch: int) -> tuple[Config, ...]:
    return DECODE_CONFIGS if batch <= DECODE_MAX_BATCH else PREFILL_CONFIGS


def _time(fn, reps: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _tuned(key: tuple, candidates: tuple[Config, ...], run) -> Config:
    """Fastest config for ``key`` on this GPU (timed once, then cached)."""
    if key not in _TUNED:
        if torch.cuda.is_current_stream_capturing():
            return candidates[0]  # never time inside a CUDA graph capture
        _TUNED[key] = min(candidates, key=lambda c: _time(lambda: run(c)))
    return _TUNED[key]


def gptq_matmul(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    group_size: int,
    config: Config | None = None,
) -> torch.Tensor:
    """y [batch, out] = x2 [batch, in] @ W^T in x2's dtype; arguments already validated by ops.py.

    ``group_size``: > 0 static groups, -1 one group, 0 act-order. ``config`` overrides the
    autotuned (GPU) or first (interpreter) config of the batch's list.
    """
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    batch = x2.shape[0]
    if batch == 0:
        return x2.new_empty(0, qweight.shape[1])
    if max(x2.shape[0] * x2.stride(0), qweight.numel(), 16 * batch * qweight.shape[1]) >= 2**31:
        # the kernel's offsets are int32 (enough for a 28672 x 8192 layer at batch 16k)
        raise LayercutError("gptq_matmul (triton): tensors past 2^31 elements are not supported")

    def run(cfg: Config) -> torch.Tensor:
        return _launch(cfg, x2, qweight, qzeros, scales, g_idx, bits, group_size, x2.dtype)

    if config is None:
        candidates = configs_for(batch)
        if INTERPRET or x2.device.type != "cuda" or os.environ.get("LAYERCUT_TRITON_AUTOTUNE") == "0":
            config = candidates[0]
        else:
            layout = "act" if group_size == 0 else ("one" if group_size == -1 else group_size)
            bucket = 1 << max(0, (batch - 1).bit_length())
            key = (x2.device.index, bits, layout, x2.dtype, bucket, x2.shape[1], qweight.shape[1])
            config = _tuned(key, candidates, run)
    return run(config)
