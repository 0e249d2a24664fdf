"""GPTQ v1 packing: bit-exact against GPTQModel 7.6.0 and against a plain-int model of the format."""

from __future__ import annotations

import pytest
import torch
from gptq_codes import random_codes

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.pack import dequantize_gptq, pack_gptq, packed_rows, unpack_gptq
from tests.conftest import import_extra

BITS = (2, 3, 4, 8)
GROUP_SIZES = (-1, 32, 64, 128)


def _random_case(bits: int, in_f: int, out_f: int, gs: int, act_order: bool, seed: int = 0, zmin: int = 1):
    q, z, s, g_idx, _ = random_codes(bits, in_f, out_f, gs, act_order, seed, zmin, scale=(0.01, 1e-3))
    return q, z, s, g_idx


def _stream_words(codes: list[int], bits: int) -> list[int]:
    """The spec, in Python ints: code i at bit i*bits of a little-endian stream of 32-bit words."""
    stream = 0
    for i, c in enumerate(codes):
        stream |= c << (i * bits)
    n_words = packed_rows(len(codes), bits)
    words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def test_known_words_4bit():
    q = torch.arange(16).repeat(8, 1) % 8  # 8 outputs, codes 0..7,0..7 along in
    z = torch.arange(1, 9).reshape(1, 8)  # zero points 1..8, stored as 0..7
    out = pack_gptq(q, z, torch.ones(1, 8), torch.zeros(16, dtype=torch.int32), bits=4)
    assert out["qweight"].T.tolist() == [[0x76543210, 0x76543210]] * 8
    assert out["qzeros"].tolist() == [[0x76543210]]


@pytest.mark.parametrize("bits", BITS)
def test_matches_plain_int_spec(bits: int):
    q, z, s, g_idx = _random_case(bits, in_f=96, out_f=64, gs=32, act_order=False)
    out = pack_gptq(q, z, s, g_idx, bits)
    for o in (0, 5, 63):
        assert out["qweight"][:, o].tolist() == _stream_words(q[o].tolist(), bits)
    for g in range(z.shape[0]):
        assert out["qzeros"][g].tolist() == _stream_words((z[g] - 1).tolist(), bits)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("act_order", [False, True])
def test_roundtrip(bits: int, gs: int, act_order: bool):
    in_f = 576  # SmolLM2 hidden size, 9 * 64: not a multiple of 128
    q, z, s, g_idx = _random_case(bits, in_f, 96, gs, act_order, zmin=0)
    out = pack_gptq(q, z, s, g_idx, bits)
    assert out["qweight"].shape == (in_f * bits // 32, 96) and out["qweight"].dtype == torch.int32
    assert out["qzeros"].shape == (z.shape[0], 96 * bits // 32) and out["qzeros"].dtype == torch.int32
    assert out["scales"].dtype == torch.float16 and out["g_idx"].dtype == torch.int32
    q2, z2 = unpack_gptq(out["qweight"], out["qzeros"], bits, in_f, 96)
    assert torch.equal(q2, q.to(torch.int32)) and torch.equal(z2, z.to(torch.int32))
    W = dequantize_gptq(out["qweight"], out["qzeros"], out["scales"], out["g_idx"], bits)
    ref = s[g_idx.long()].T * (q.float() - z[g_idx.long()].T.float())
    assert torch.equal(W, ref)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ragged_in_features(bits: int):
    # in not a multiple of 32/bits: the last word is partly padding (GPTQModel's ceil shape)
    q, z, s, g_idx = _random_case(bits, in_f=100, out_f=12, gs=-1, act_order=False)
    out = pack_gptq(q, z, s, g_idx, bits)
    assert out["qweight"].shape[0] == (100 * bits + 31) // 32
    q2, z2 = unpack_gptq(out["qweight"], out["qzeros"], bits, 100, 12)
    assert torch.equal(q2, q.to(torch.int32)) and torch.equal(z2, z.to(torch.int32))


def test_rejects_bad_input():
    q = torch.full((4, 32), 16)
    with pytest.raises(LayercutError, match=r"\[0, 15\]"):
        pack_gptq(q, torch.ones(1, 4), torch.ones(1, 4), torch.zeros(32, dtype=torch.int32), 4)
    with pytest.raises(LayercutError, match="bits"):
        pack_gptq(q, torch.ones(1, 4), torch.ones(1, 4), torch.zeros(32, dtype=torch.int32), 5)
    with pytest.raises(LayercutError, match="g_idx"):
        pack_gptq(q.clamp(max=3), torch.ones(1, 4), torch.ones(1, 4), torch.ones(32, dtype=torch.int32), 4)


@pytest.fixture(scope="module")
def gptqmodel_api():
    import_extra("gptqmodel")  # fails (not skips) under CI: see tests.conftest.import_extra
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization import QuantizeConfig
    from gptqmodel.utils.model import (
        convert_gptq_v1_to_v2_format_module,
        convert_gptq_v2_to_v1_format_module,
    )

    return (
        TorchLinear,
        QuantizeConfig,
        convert_gptq_v1_to_v2_format_module,
        convert_gptq_v2_to_v1_format_module,
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs,act_order", [(-1, False), (32, False), (64, True), (128, False), (128, True)])
def test_bit_exact_with_gptqmodel(gptqmodel_api, bits: int, gs: int, act_order: bool):
    """GPTQModel packs (internal v2 zeros) and converts to v1 as its save path does; the bytes
    must equal ours, and its torch kernel must dequantize our tensors to our weight."""
    TorchLinear, QuantizeConfig, v1_to_v2, v2_to_v1 = gptqmodel_api
    in_f, out_f = 576, 96
    # zero points include 0 for 2/4/8 bits: the word-wise v1 offset must still match byte for byte
    q, z, s, g_idx = _random_case(bits, in_f, out_f, gs, act_order, zmin=0 if bits != 3 else 1)
    ours = pack_gptq(q, z, s, g_idx, bits)

    theirs = TorchLinear(
        bits=bits,
        group_size=gs,
        sym=False,
        desc_act=act_order,
        in_features=in_f,
        out_features=out_f,
        bias=False,
    )
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = s[g_idx.long()].T * (q.float() - z[g_idx.long()].T.float())
    theirs.pack_original(linear, s.T.contiguous(), z.T.contiguous(), g_idx)
    v2_to_v1(theirs, QuantizeConfig(bits=bits))
    assert torch.equal(theirs.qweight, ours["qweight"])
    assert torch.equal(theirs.qzeros, ours["qzeros"])
    assert torch.equal(theirs.scales, ours["scales"])

    # load our v1 tensors the way GPTQModel loads a v1 checkpoint, then dequantize with its kernel
    loaded = TorchLinear(
        bits=bits,
        group_size=gs,
        sym=False,
        desc_act=act_order,
        in_features=in_f,
        out_features=out_f,
        bias=False,
    )
    loaded.load_state_dict(ours, strict=False)
    v1_to_v2(loaded, bits, torch.int32)
    their_w = loaded.dequantize_weight().T.float()  # [out, in], fp16-rounded
    our_w = dequantize_gptq(ours["qweight"], ours["qzeros"], ours["scales"], ours["g_idx"], bits)
    assert torch.equal(their_w, our_w.half().float())
