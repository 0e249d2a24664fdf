"""Least-squares scales for GPTQ's final codes (compress/quant/solve/scale_fit.py): the per-row optimum,
never worse than the scales GPTQ fixed, the same codes and zeros, the loss it reports, the
degenerate rows it must leave alone, and a refit checkpoint that loads."""

from __future__ import annotations

import os

import pytest
import torch

from layercut.compress.quant.solve.driver import quantize_model
from layercut.compress.quant.solve.gptq import gptq_quantize, layer_loss
from layercut.compress.quant.solve.scale_fit import refit_scales
from tests.plain_solver import plain_solver
from tests.test_scale_search import GS, _outlier_layer

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
ORDERS = [dict(act_order=True, static_groups=True), dict(act_order=True), dict(group_aware=True), dict()]


def _lstsq_scales(W, H, res) -> torch.Tensor:
    """Each row's optimum by a dense float64 least squares on H^½ (no fp16 rounding): [groups, out]."""
    L = torch.linalg.cholesky(H.double() + 1e-9 * torch.eye(H.shape[0], dtype=torch.float64))  # H = L Lᵀ
    g = res.g_idx.long()
    G = res.scales.shape[0]
    out = torch.empty(G, W.shape[0], dtype=torch.float64)
    for r in range(W.shape[0]):
        v = res.q[r].double() - res.zeros[g, r].double()
        B = torch.zeros(W.shape[1], G, dtype=torch.float64)
        B[torch.arange(W.shape[1]), g] = v
        out[:, r] = torch.linalg.lstsq(L.T @ B, L.T @ W[r].double()).solution
    return out


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bits", [4, 3])
def test_refit_is_the_rows_least_squares_optimum_and_never_worse(order, bits):
    """Red if the systems were built wrong (another column order, the zeros ignored, M not
    symmetric in g, g'), if the codes or zeros moved, or if a worse row were kept."""
    W, _, H = _outlier_layer()
    base = gptq_quantize(W, H, bits, GS, scale_search="hessian", **order)
    fit = gptq_quantize(W, H, bits, GS, scale_search="hessian", refit=True, **order)
    for f in ("q", "zeros", "g_idx"):
        assert torch.equal(fit.q if f == "q" else getattr(fit, f), getattr(base, f)), f
    assert torch.equal(fit.scales, fit.scales.half().float())  # stored as fp16
    assert not torch.equal(fit.scales, base.scales)
    assert layer_loss(W, fit.dequant, H) < layer_loss(W, base.dequant, H) * 0.995
    best = _lstsq_scales(W, H, base)
    torch.testing.assert_close(fit.scales.double(), best, rtol=2e-3, atol=1e-6)  # fp16 rounding apart


@pytest.mark.parametrize("order", ORDERS[:2])
def test_reported_loss_is_the_damped_objective_of_the_refit_weights(order):
    """``loss`` (what sensitivity and allocation read) must describe the refit weights."""
    W, _, H = _outlier_layer()
    fit = gptq_quantize(W, H, 3, GS, scale_search="hessian", refit=True, **order)
    lam = fit.damp_used * float(H.diagonal().mean())
    exact = layer_loss(W, fit.dequant, H + lam * torch.eye(H.shape[0]))
    assert fit.loss == pytest.approx(exact, rel=1e-5)


def test_degenerate_rows_keep_their_scales():
    """A group whose codes all sit at the zero point and a row whose best scale is negative keep
    the old scales (red if they were solved as a singular system or stored as a flipped sign)."""
    torch.manual_seed(0)
    out_f, in_f, gs = 3, 8, 4
    H = torch.eye(in_f) + 0.1
    q = torch.full((out_f, in_f), 5, dtype=torch.int32)
    zeros = torch.full((2, out_f), 5, dtype=torch.int32)
    q[0, :4] = torch.tensor([6, 7, 4, 3], dtype=torch.int32)  # row 0: group 1 all at the zero point
    q[1] = torch.tensor([6, 7, 4, 3, 6, 4, 7, 3], dtype=torch.int32)
    q[2] = q[1]
    g_idx = torch.arange(in_f) // gs
    scales = torch.full((2, out_f), 0.5)
    W = torch.zeros(out_f, in_f)
    W[0, :4] = 0.5 * (q[0, :4] - 5).float() * 1.25
    W[1] = 0.5 * (q[1] - 5).float() * 0.8
    W[2] = -0.5 * (q[2] - 5).float()  # the best scale is -0.5
    new, gain = refit_scales(W, H, q, zeros, g_idx, scales)
    assert new[1, 0] == 0.5 and new[0, 0] == pytest.approx(0.625, rel=1e-3)
    assert new[:, 1].tolist() == pytest.approx([0.4, 0.4], rel=1e-3)
    assert new[:, 2].tolist() == [0.5, 0.5]  # negative optimum: unchanged
    assert gain > 0 and torch.isfinite(new).all()


def test_options_are_checked():
    from pydantic import ValidationError

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.plan import solver_settings

    assert solver_settings(QuantizeConfig(bits=4, refit_scales=True), GS).refit_scales
    with pytest.raises(ValidationError, match="refit_scales works with method gptq"):
        QuantizeConfig(bits=4, method="rtn", refit_scales=True)


def test_refit_checkpoint_loads_and_lowers_every_layers_loss(tmp_path, tiny_tokenizer):
    """A tiny llama quantized with refit: every linear's loss is at most the plain run's (same
    calibration, so the first block's Hessians are identical), the fp16 scales decode to the
    in-memory weights, and the checkpoint loads in layercut's loader."""
    from layercut.compress.quant.format.checkpoint import save_quantized
    from layercut.compress.quant.format.loader import load_quantized
    from tests.test_quantize import ATOL, _calib, _probe, small_model

    runs = {}
    for refit in (False, True):
        model = small_model("llama")
        cfg = plain_solver(bits=3, group_size=GS, act_order=True, static_groups=True, scale_search="hessian",
                          refit_scales=refit)
        runs[refit] = (model, quantize_model(model, _calib(tiny_tokenizer), cfg, batch_size=4, progress=False))
    (_, plain), (model, res) = runs[False], runs[True]
    first = [n for n in res.layers if ".0." in n]
    assert first and all(res.layers[n].loss <= plain.layers[n].loss for n in first)
    assert sum(ql.loss for ql in res.layers.values()) < sum(ql.loss for ql in plain.layers.values())
    path = tmp_path / "q"
    save_quantized(model, tiny_tokenizer, res, path)
    probe = _probe(tiny_tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(path)(probe).logits, model(probe).logits, atol=ATOL, rtol=0)
