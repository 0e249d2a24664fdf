"""GPTQ v1 packing: integer codes <-> the int32 tensors GPTQ checkpoints store.

Usage::

    from layercut.compress.quant.format.pack import pack_gptq, dequantize_gptq
    t = pack_gptq(q, zeros, scales, g_idx, bits=4)   # q: [out, in], zeros/scales: [groups, out]
    W = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=4)  # [out, in]

The layout is the one GPTQModel/AutoGPTQ write with ``checkpoint_format="gptq"`` (v1),
which vLLM, SGLang, GPTQModel and transformers load:

* ``qweight`` int32 [ceil(in*bits/32), out]: each output column holds the codes of its
  ``in`` inputs as a little-endian bit stream, code ``i`` at bit ``i*bits`` of the
  concatenated 32-bit words.  For 2/4/8 bits no code straddles a word; for 3 bits 32 codes
  fill exactly 3 words (the "10 | 1 | 10 | 1 | 10" scheme is that stream).
* ``qzeros`` int32 [groups, ceil(out*bits/32)]: the zero points of each group packed the same
  way along ``out``, stored as ``zero - 1`` (the legacy v1 offset).  GPTQModel applies the
  offset as a packed-word subtraction for 2/4/8 bits and per field (mod 2**bits) for 3 bits;
  we do the same so the bytes match, and undo it the same way.  The two agree whenever every
  zero point is >= 1 (always with symmetric quantization).  A zero point of 0 (possible with
  asymmetric quantization) has no unambiguous v1 encoding: loaders that undo the offset per
  field (vLLM's kernels) read that group differently from GPTQModel's loader. Quantizers
  that target every loader should keep zero points in [1, 2**bits - 1].
* ``scales`` fp16 [groups, out]; ``g_idx`` int32 [in] (group of each input; arbitrary under
  act-order).

W[o, i] = scales[g_idx[i], o] * (q[o, i] - zeros[g_idx[i], o]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.result import SUPPORTED_BITS

SLICE_ELEMENTS = 1 << 22  # qweight is packed in slices of output columns of about this many codes

_MASK32 = (1 << 32) - 1


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise LayercutError(f"GPTQ packing supports bits in {SUPPORTED_BITS}, got {bits}")


def packed_rows(n: int, bits: int) -> int:
    """Number of int32 words that hold ``n`` codes of ``bits`` bits (ceil(n*bits/32))."""
    return (n * bits + 31) // 32


def _to_int32(words: Tensor) -> Tensor:
    """Reinterpret uint32 values held in int64 as int32 (two's complement)."""
    words = words & _MASK32
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def pack_rows(codes: Tensor, bits: int) -> Tensor:
    """Pack codes along dim 0 as a little-endian bit stream.

    codes: [n, m] ints in [0, 2**bits)  ->  words: [ceil(n*bits/32), m] int32
    """
    n, m = codes.shape
    codes = codes.to(torch.int64)
    n_words = packed_rows(n, bits)
    # one extra word catches spills past the last word; it is always zero and dropped
    acc = torch.zeros(n_words + 1, m, dtype=torch.int64, device=codes.device)
    offset = torch.arange(n, device=codes.device) * bits  # bit offset of code i
    word = offset // 32
    shift = (offset % 32).unsqueeze(1)  # [n, 1]
    # fields are disjoint, so adding the shifted codes into their words is a bitwise OR
    acc.index_add_(0, word, (codes << shift) & _MASK32)
    spill = (shift + bits > 32).squeeze(1)
    if bool(spill.any()):  # only 3 bits: the high part of a code continues in the next word
        acc.index_add_(0, word[spill] + 1, codes[spill] >> (32 - shift[spill]))
    return _to_int32(acc[:n_words])


def _unpack_rows(words: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_rows`. words: [ceil(n*bits/32), m] int32 -> codes [n, m] int32."""
    w = words.to(torch.int64) & _MASK32
    w = torch.cat([w, torch.zeros_like(w[:1])], dim=0)  # room for the spill read
    offset = torch.arange(n, device=words.device) * bits
    word = offset // 32
    shift = (offset % 32).unsqueeze(1)
    lo = w[word] >> shift
    hi = w[word + 1] << (32 - shift)  # bits of a code that continue in the next word
    return ((lo | hi) & ((1 << bits) - 1)).to(torch.int32)


def _ones_pattern(bits: int) -> int:
    """A word with the value 1 in every ``bits``-wide field (0x11111111 for 4 bits)."""
    return sum(1 << s for s in range(0, 32, bits))


def _apply_v1_offset(qzeros_v2: Tensor, bits: int, out_features: int, sign: int) -> Tensor:
    """Subtract (sign=-1) or add (sign=+1) one to every packed zero point, GPTQModel's way."""
    if bits == 3:  # per field, mod 8 (fields straddle words)
        codes = _unpack_rows(qzeros_v2.T, bits, out_features)
        return pack_rows((codes + sign) & 0x7, bits).T.contiguous()
    words = (qzeros_v2.to(torch.int64) & _MASK32) + sign * _ones_pattern(bits)
    return _to_int32(words)


def pack_gptq(q: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int) -> dict[str, Tensor]:
    """Pack integer codes into GPTQ v1 tensors.

    q:      [out, in] ints in [0, 2**bits)
    zeros:  [groups, out] ints in [0, 2**bits) (the true zero points, no offset)
    scales: [groups, out] float
    g_idx:  [in] group index of every input column

    Returns ``qweight`` [ceil(in*bits/32), out] int32, ``qzeros`` [groups,
    ceil(out*bits/32)] int32 (zero - 1), ``scales`` [groups, out] fp16, ``g_idx`` [in] int32.
    """
    _check_bits(bits)
    if q.dim() != 2 or zeros.dim() != 2 or scales.shape != zeros.shape:
        raise LayercutError(
            f"pack_gptq: expected q [out, in] and zeros/scales [groups, out] of one shape, got "
            f"q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}"
        )
    out_features, in_features = q.shape
    groups = zeros.shape[0]
    if zeros.shape[1] != out_features or g_idx.shape != (in_features,):
        raise LayercutError(
            f"pack_gptq: shapes disagree: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"g_idx {tuple(g_idx.shape)}"
        )
    maxq = (1 << bits) - 1
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > maxq):
        raise LayercutError(f"pack_gptq: codes must lie in [0, {maxq}] for {bits} bits")
    if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) > maxq):
        raise LayercutError(f"pack_gptq: zero points must lie in [0, {maxq}] for {bits} bits")
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise LayercutError(f"pack_gptq: g_idx values must lie in [0, {groups})")

    # [in*bits/32, out], in slices of output columns: pack_rows's int64 temporaries stay ≤ 32 MB each
    # (codes of different columns never share a word, so the slices pack independently)
    step = max(1, SLICE_ELEMENTS // max(in_features, 1))
    qweight = torch.cat([pack_rows(q[j : j + step].T, bits) for j in range(0, out_features, step)], dim=1) \
        if out_features > step else pack_rows(q.T, bits)
    qzeros_v2 = pack_rows(zeros.T, bits).T.contiguous()  # [groups, out*bits/32]
    return {
        "qweight": qweight.contiguous(),
        "qzeros": _apply_v1_offset(qzeros_v2, bits, out_features, sign=-1),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def unpack_gptq(
    qweight: Tensor, qzeros: Tensor, bits: int, in_features: int, out_features: int
) -> tuple[Tensor, Tensor]:
    """Unpack GPTQ v1 tensors into codes.

    qweight: [ceil(in*bits/32), out] int32; qzeros: [groups, ceil(out*bits/32)] int32 (zero - 1)
    Returns q [out, in] int32 and zeros [groups, out] int32 with the v1 offset undone.
    """
    _check_bits(bits)
    if qweight.shape != (packed_rows(in_features, bits), out_features):
        raise LayercutError(
            f"unpack_gptq: qweight shape {tuple(qweight.shape)} does not match in={in_features}, "
            f"out={out_features}, bits={bits}"
        )
    if qzeros.dim() != 2 or qzeros.shape[1] != packed_rows(out_features, bits):
        raise LayercutError(
            f"unpack_gptq: qzeros shape {tuple(qzeros.shape)} does not match out={out_features}, bits={bits}"
        )
    q = _unpack_rows(qweight, bits, in_features).T.contiguous()
    qzeros_v2 = _apply_v1_offset(qzeros, bits, out_features, sign=+1)
    zeros = _unpack_rows(qzeros_v2.T, bits, out_features).T.contiguous()
    return q, zeros


def dequantize_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """Dequantize GPTQ v1 tensors to a float32 weight W [out, in].

    W[o, i] = scales[g_idx[i], o] * (q[o, i] - zeros[g_idx[i], o]); shapes as in :func:`pack_gptq`.
    """
    in_features, out_features = g_idx.shape[0], scales.shape[1]
    q, zeros = unpack_gptq(qweight, qzeros, bits, in_features, out_features)
    g = g_idx.to(torch.long)
    s = scales.to(torch.float32)
    # s[g]: [in, out] -> transpose to [out, in]
    return (s[g].T * (q.to(torch.float32) - zeros[g].T.to(torch.float32))).contiguous()
