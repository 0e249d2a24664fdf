"""benchmarks/sensitivity_exact.py on a tiny llama: the pieces its table rests on.

Run: ``python -m pytest -q tests/test_sensitivity_exact.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layercut.calibrate.data import calibration_batch
from layercut.compress.core.arch import arch_for
from layercut.compress.quant.solve.driver import linear_weight, quantize_model, set_weight
from layercut.compress.quant.solve.settings import SolverConfig
from tests.conftest import tiny_config
from tests.plain_solver import plain_solver

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def se():
    spec = importlib.util.spec_from_file_location("sensitivity_exact", ROOT / "benchmarks" / "sensitivity_exact.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sensitivity_exact"] = mod
    spec.loader.exec_module(mod)
    return mod


def _model(layers: int = 3):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _cfg() -> SolverConfig:
    return plain_solver(bits=3, group_size=64, act_order=True, static_groups=True, damp=0.01, sequential="block")


def _fp(model, units):
    spec = arch_for(model)
    return {n: linear_weight(model.get_submodule(n), spec.conv1d).detach().clone() for u in units for n in u.linears}


def test_baseline_matches_quantize_stage(se, tiny_tokenizer):
    """The script's own sequential pass (it must keep the Hessians) is the quantize stage's."""
    calib = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=8, seq_len=32, seed=0)
    ref, ours = _model(), _model()
    quantize_model(ref, calib, _cfg(), progress=False)
    units = se.units_of(ours)
    fp = _fp(ours, units)
    H = se.quantize_sequential(ours, fp, calib, _cfg(), units, hessian_dtype=torch.float64)
    assert sorted(H) == sorted(u.name for u in units) and len(units) == 3 * 4
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        assert torch.equal(a, b), name
    # run again on the quantized model (as the checks do): each block is reset to dense first
    se.quantize_sequential(ours, fp, calib, _cfg(), units, hessian_dtype=torch.float64)
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        assert torch.equal(a, b), name


@torch.no_grad()
def test_partial_rerun_equals_full_forward(se, tiny_tokenizer):
    """Δ from the cached baseline stream (blocks b.. only) equals a full forward's KL."""
    calib = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=8, seq_len=32, seed=0)
    data = se.eval_set(tiny_tokenizer, "bundled:brown-calib", windows=3, seq_len=24, offset=5000)
    model = _model()
    fp_logp = F.log_softmax(model(input_ids=data.input_ids).logits.float(), -1)
    units = se.units_of(model)
    fp = _fp(model, units)
    probe = se.KLProbe(model, data, batch_size=2)
    assert probe.kl_from(0)["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference itself
    H = se.quantize_sequential(model, fp, calib, _cfg(), units)
    base = probe.anchor()
    u = next(u for u in units if u.name.endswith("layers.1.gate_up"))
    for n, w in zip(u.linears, se.solve_unit(u, fp, H[u.name], _cfg(), (2, 32))[0]):
        set_weight(model.get_submodule(n), w, False)
    fast = probe.kl_from(u.block)
    logq = F.log_softmax(model(input_ids=data.input_ids).logits.float(), -1)
    full = float((fp_logp.exp() * (fp_logp - logq)).sum(-1).mean())
    assert fast["kl"] == pytest.approx(full, rel=1e-4)
    assert fast["kl"] != pytest.approx(base["kl"], rel=1e-3)  # the unit really changed


def test_costs_reproduce_issue_figures(se):
    """SmolLM2 shapes: 2/3/4-bit g64 cost 2.28/3.30/4.31 bits per weight; g128 fits down only."""
    units = []
    for i in range(30):
        for kind, out_f, in_f in (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)):
            units.append({"name": f"model.layers.{i}.{kind}", "n_weights": out_f * in_f, "n_rows": out_f,
                          "in_features": in_f})
    got = [round(se.uniform_bits(units, (b, 64)), 2) for b in (2, 3, 4)]
    assert got == [2.28, 3.30, 4.31]
    assert se.uniform_bits(units, (3, 128)) is None
    assert se.uniform_bits(units, (4, -1)) == pytest.approx(4 + 20 * (960 + 576 + 3072 + 576) * 30
                                                            / sum(u["n_weights"] for u in units))


def test_dp_is_the_brute_force_optimum(se):
    """The DP over a partial table (inf = unmeasured) finds the best allocation that fits."""
    rng = np.random.default_rng(0)
    units = [{"name": f"u{i}", "n_weights": 64 * r, "n_rows": r, "in_features": 64} for i, r in enumerate((8, 16, 24, 8))]
    cands = [(3, 64), (2, 64), (4, 64), (3, 32), (8, -1)]
    D = rng.normal(size=(4, 5))
    D[:, 0] = 0.0
    D[:, 1] = np.abs(D[:, 1])  # 2-bit always hurts
    D[2, 3] = np.inf  # not measured yet
    n = sum(u["n_weights"] for u in units)
    best = min((sum(D[i, k] for i, k in enumerate(p)), p) for p in itertools.product(range(5), repeat=4)
               if np.isfinite(sum(D[i, k] for i, k in enumerate(p)))
               and sum(se._cost(u, cands[k]) for u, k in zip(units, p)) <= 3.6 * n)
    r = se.solve_budget(units, cands, D, 3.6)
    assert r["feasible"] and r["avg_bits"] <= 3.6
    assert r["sum_delta"] == pytest.approx(best[0])
    assert not se.solve_budget(units, cands, D, 2.0)["feasible"]
