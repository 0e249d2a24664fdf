"""QuantLinear: construction from GPTQ output, checkpoint-compatible state dicts, forward."""

from __future__ import annotations

import pytest
import torch
from gptq_codes import random_codes, small_int_x
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from layercut.compress.core.errors import LayercutError
from layercut.compress.kernels import ops
from layercut.compress.kernels.ops import ACT_ORDER
from layercut.compress.quant.format.qlinear import QuantLinear


def gptq_output(bits: int, in_f: int, out_f: int, gs: int, act_order: bool = False, seed: int = 0):
    return random_codes(bits, in_f, out_f, gs, act_order, seed)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs,act_order", [(-1, False), (64, False), (128, True)])
def test_from_dense_forward_matches_dense(bits: int, gs: int, act_order: bool):
    q, z, s, g_idx, w = gptq_output(bits, 576, 48, gs, act_order)
    linear = nn.Linear(576, 48, bias=True)
    ql = QuantLinear.from_dense(linear, q, z, s, g_idx, bits, gs)
    assert torch.equal(ql.dequantize(), w)
    x = torch.randn(2, 5, 576)
    expected = x.double() @ w.double().T + linear.bias.detach().half().double()
    torch.testing.assert_close(ql(x).double(), expected, rtol=1e-5, atol=1e-4)
    assert ql._kernel_group_size() == (ACT_ORDER if act_order else gs)


def test_state_dict_names_shapes_dtypes():
    q, z, s, g_idx, _ = gptq_output(4, 576, 64, 128)
    ql = QuantLinear.from_dense(nn.Linear(576, 64, bias=False), q, z, s, g_idx, 4, 128)
    sd = ql.state_dict()
    assert set(sd) == {"qweight", "qzeros", "scales", "g_idx"}
    assert sd["qweight"].shape == (576 * 4 // 32, 64) and sd["qweight"].dtype == torch.int32
    assert sd["qzeros"].shape == (5, 64 * 4 // 32) and sd["qzeros"].dtype == torch.int32
    assert sd["scales"].shape == (5, 64) and sd["scales"].dtype == torch.float16
    assert sd["g_idx"].shape == (576,) and sd["g_idx"].dtype == torch.int32


def test_loads_from_gptq_safetensors(tmp_path):
    """A model-level GPTQ checkpoint (<module>.qweight, ...) loads straight into empty layers."""
    q, z, s, g_idx, w = gptq_output(3, 576, 64, 64, act_order=True)
    src = QuantLinear.from_dense(nn.Linear(576, 64, bias=True), q, z, s, g_idx, 3, 64)
    model = nn.ModuleDict({"proj": src})
    path = tmp_path / "model.safetensors"
    save_file(
        {f"layers.0.{k}": v.contiguous() for k, v in model.state_dict().items()},
        str(path),
        metadata={"format": "pt"},
    )

    with torch.device("meta"):
        empty = nn.ModuleDict({"proj": QuantLinear(576, 64, bits=3, group_size=64, bias=True)})
    with safe_open(str(path), "pt") as f:
        state = {k.removeprefix("layers.0."): f.get_tensor(k) for k in f.keys()}
    empty.load_state_dict(state, strict=True, assign=True)
    x = torch.randn(3, 576)
    assert torch.equal(empty["proj"](x), src(x))
    assert empty["proj"]._kernel_group_size() == ACT_ORDER

    plain = QuantLinear(576, 64, bits=3, group_size=64, bias=True)  # non-meta, in-place copy
    plain.load_state_dict({k.removeprefix("proj."): v for k, v in state.items()}, strict=True)
    assert torch.equal(plain.dequantize(), w)


def test_kernel_group_size_follows_loaded_g_idx():
    q, z, s, g_idx, _ = gptq_output(4, 256, 32, 32)
    ql = QuantLinear.from_dense(nn.Linear(256, 32), q, z, s, g_idx, 4, 32)
    assert ql._kernel_group_size() == 32
    with torch.no_grad():
        ql.g_idx.copy_(g_idx.flip(0))  # an act-order permutation loaded in place
    assert ql._kernel_group_size() == ACT_ORDER
    one = QuantLinear(256, 32, bits=4, group_size=-1)
    assert one._kernel_group_size() == -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_matches_op(dtype: torch.dtype):
    q, z, s, g_idx, _ = gptq_output(4, 256, 32, 64)
    ql = QuantLinear.from_dense(nn.Linear(256, 32), q, z, s, g_idx, 4, 64)
    cached = QuantLinear.from_dense(nn.Linear(256, 32), q, z, s, g_idx, 4, 64, cache_dequantized=True)
    cached.load_state_dict(ql.state_dict())
    x = torch.randn(4, 256).to(dtype)
    assert torch.equal(cached(x), ql(x))
    assert cached._cached_weight is not None
    with torch.no_grad():
        cached.scales.mul_(2)  # in-place change invalidates the cache
    torch.testing.assert_close(
        cached(x).float(), 2 * (ql(x).float() - ql.bias.float()) + ql.bias.float(), rtol=1e-2, atol=1e-2
    )


def test_rejects_bad_config():
    with pytest.raises(LayercutError, match="bits"):
        QuantLinear(64, 64, bits=5)
    with pytest.raises(LayercutError, match="group_size"):
        QuantLinear(64, 64, bits=4, group_size=0)
    q, z, s, g_idx, _ = gptq_output(4, 64, 8, 32)
    with pytest.raises(LayercutError, match="codes"):
        QuantLinear.from_dense(nn.Linear(32, 8), q, z, s, g_idx, 4, 32)


@pytest.mark.parametrize("cache", [False, True])
def test_forward_runs_the_triton_kernel_under_the_interpreter(monkeypatch, cache: bool):
    """Under TRITON_INTERPRET=1 the layer goes through the op's Triton kernel (the fp32 cache
    is bypassed) and, on exact data, gives the dense product plus bias bitwise."""
    q, z, s, g_idx, w = random_codes(3, 96, 40, 32, act_order=True, zmin=0, pow2_scales=(4, 6))
    linear = nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.bias.copy_(torch.arange(40) / 8)  # exact in fp16
    ql = QuantLinear.from_dense(linear, q, z, s, g_idx, 3, 32, cache_dequantized=cache)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LAYERCUT_KERNELS", "triton")
    ops.reset_kernel_calls()
    x = small_int_x((3, 96))
    y = ql(x)
    assert ops.kernel_calls() == {"triton": 1} and ql._cached_weight is None
    assert torch.equal(y, (x.double() @ w.double().T + linear.bias.double()).float())
