"""``--sensitivity kl-swap``: full quantizations, the true KL of swapping one unit, the allocation, the checkpoint.

Tiny llama (hidden 64, intermediate 128, 3 layers): every unit takes g32.
"""

from __future__ import annotations

import json

import pytest
import torch

from layercut.compress.quant.format.loader import load_quantized
from layercut.compress.quant.search.allocate import allocate_bits, uniform_avg_bits
from layercut.compress.quant.search.mixed import compare_kl, float_weights, held_apart
from layercut.compress.quant.search.sensitivity import allocation_units
from layercut.compress.quant.search.swap import measure_swaps, quantize_variants, swap_candidates
from layercut.compress.workflow.cli import main
from tests.plain_solver import plain_solver
from tests.test_quantize import _calib, small_model

CANDS = [(3, -1), (3, 32), (4, 32)]
HOT = "model.layers.1.down"  # the unit the constructed case makes sensitive


def _hot_model():
    """The tiny llama with layer 1's down_proj 20x larger: its quantization error enters the residual
    stream 20x larger, so 4 bits there lower the KL most per byte (measured: 2x the next unit's rate)."""
    model = small_model()
    with torch.no_grad():
        model.get_submodule("model.layers.1.mlp.down_proj").weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def hot_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("hot-llama")
    _hot_model().save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_swaps_equal_the_whole_model_kl(tiny_tokenizer):
    """Each streamed Δ_u(c) (a swap stream from u's block onward) equals the KL of the whole model
    with the baseline everywhere but u at c, computed directly. Red if a swap stream started from
    the float stream instead of the baseline's, ran later blocks at float (or swapped) weights, or
    the head were applied to the wrong stream."""
    model = small_model()
    fp = float_weights(model)
    units = allocation_units(model, "group")
    cfg = plain_solver(group_size=32, act_order=True, static_groups=True)
    base, variants = quantize_variants(model, _calib(tiny_tokenizer, 4, 32), cfg, units, (3, 32), CANDS,
                                       batch_size=2, progress=False)
    held, _ = held_apart(tiny_tokenizer, "bundled:brown-calib", 3, 32, 0, 4, part=1)
    from layercut.compress.quant.search.mixed import load_weights

    load_weights(model, fp)
    table = measure_swaps(model, held, units, variants, batch_size=2, progress=False,
                          max_stream_bytes=5 * 3 * 32 * 64 * 4)  # 4 swaps per pass: several passes
    assert table.passes > 1 and table.swaps == len(units) * 2
    base_w = {n: variants.weight((3, 32), n) for u in units for n in u.linears}
    kls, _ = compare_kl(model, held, fp, {"base": base_w}, batch_size=2)
    assert table.base_kl == pytest.approx(kls["base"], rel=1e-4)
    for u in units[1::3]:  # a few units, in different blocks
        for c in ((3, -1), (4, 32)):
            swapped = dict(base_w) | {n: variants.weight(c, n) for n in u.linears}
            load_weights(model, fp)
            kl, _ = compare_kl(model, held, fp, {"s": swapped}, batch_size=2)
            assert table.delta[u.name][c] == pytest.approx(kl["s"] - kls["base"], rel=1e-3, abs=1e-6), (u.name, c)
    assert base.avg_bits() == pytest.approx(uniform_avg_bits([u.to_unit({}) for u in units], (3, 32)))


def test_default_swap_candidates():
    """Around a 3g64 baseline: 3ch (cheaper) and 4g64 (dearer); a listed set is kept as given.
    Red if the default grew (each candidate is a forward per unit) or skipped the cheaper side."""
    from tests.test_mixed_precision import _unit

    units = [_unit("a", [(8, 64)]), _unit("b", [(8, 128)])]
    assert swap_candidates(units, (3, 64), None) == [(3, -1), (3, 64), (4, 64)]
    assert swap_candidates(units, (4, -1), None) == [(4, -1), (8, -1)]
    assert swap_candidates(units, (3, 64), [(4, 64), (3, 64)]) == [(3, 64), (4, 64)]


def _run(hot_dir, out, avg_bits, *extra):
    return main(["quantize", str(hot_dir), "-o", str(out), "--avg-bits", str(avg_bits), "--candidates",
                 "3g32,4g32", "--sensitivity", "kl-swap", "--samples", "4", "--seq-len", "32",
                 "--sensitivity-samples", "3", "--batch-size", "2", "--json", *extra])


def _budget_one_promotion(model, name: str) -> float:
    """Uniform 3g32 bytes plus what moving unit ``name`` alone to 4g32 costs."""
    units = [u.to_unit({}) for u in allocation_units(model, "group")]
    total = sum(u.n_weights for u in units)
    hot = next(u for u in units if u.name == name)
    return uniform_avg_bits(units, (3, 32)) + (hot.cost((4, 32)) - hot.cost((3, 32))) / total


def test_the_unit_whose_swap_helps_most_is_promoted_and_written(hot_dir, tmp_path, capsys):
    """A budget with room for exactly the hot unit's promotion: kl-swap measures its 4-bit swap as the
    best KL drop per byte and promotes it; the checkpoint's stored bits are the allocation's cost to
    the bit (as the writer writes them) within the budget, and each linear loads at its planned bits
    and group size. Red if the swap measure missed the outlier unit (e.g. all streams the same), the
    DP overspent, or the written bits differed from allocation.json."""
    from safetensors import safe_open

    budget = _budget_one_promotion(small_model(), HOT)
    out = tmp_path / "hot"
    code = _run(hot_dir, out, budget)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    alloc = json.loads((out / "allocation.json").read_text())
    deltas = {u["name"]: u["delta"] for u in alloc["units"]}
    units = {u.name: u.to_unit({}) for u in allocation_units(small_model(), "group")}
    rate = {n: (d["4g32"] - d["3g32"]) / (units[n].cost((4, 32)) - units[n].cost((3, 32))) for n, d in deltas.items()}
    hot = HOT
    assert min(rate, key=rate.get) == hot, rate
    assert report["written"] == "mixed" and report["config_histogram"] == {"3g32": 11, "4g32": 1}
    assert {u["name"]: u["config"] for u in alloc["units"]}[hot] == "4g32"
    assert alloc["sensitivity"]["method"] == "kl-swap" and alloc["sensitivity"]["swaps"] == 12
    assert "disjoint" in alloc["sensitivity"]["data"]  # held apart from the Hessians' sequences
    stored = n = 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith((".qweight", ".qzeros", ".scales")):
                    t = fh.get_tensor(k)
                    stored += t.numel() * t.element_size() * 8
                if k.endswith(".g_idx"):
                    n += fh.get_tensor(k).shape[0] * fh.get_tensor(k[: -len("g_idx")] + "scales").shape[1]
    cost = sum(units[u["name"]].cost((u["bits"], u["group_size"])) for u in alloc["units"])
    assert stored == cost <= budget * n + 1e-6 * n
    model = load_quantized(out)
    for u in alloc["units"]:
        for name in u["linears"]:
            m = model.get_submodule(name)
            assert (m.bits, m.group_size) == (u["bits"], u["group_size"]), name
    # the same table re-solved by hand gives the written plan
    table = [units[name].__class__(units[name].name, units[name].n_weights,
                                   {(3, 32): d["3g32"], (4, 32): d["4g32"]}, n_rows=units[name].n_rows,
                                   in_features=units[name].in_features) for name, d in deltas.items()]
    assert allocate_bits(table, budget).labels() == {u["name"]: u["config"] for u in alloc["units"]}


def test_kl_swap_streams_like_the_whole_model(hot_dir, tmp_path):
    """Streamed (one block in memory; the baseline written as it goes and reused by the fallback check)
    == whole model: the same Δ table, allocation, verdict and tensors. Red if the streamed path
    measured other models, or left the .uniform folder behind."""
    from safetensors.torch import load_file

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.stages.quantize import run

    kw = dict(avg_bits=_budget_one_promotion(small_model(), HOT), candidates="3g32,4g32",
              sensitivity="kl-swap", samples=4, seq_len=32, sensitivity_samples=3, batch_size=2)
    s = run(QuantizeConfig(**kw), str(hot_dir), tmp_path / "s")
    w = run(QuantizeConfig(whole_model=True, **kw), str(hot_dir), tmp_path / "w")
    assert s["unit_bits"] == w["unit_bits"] and s["written"] == w["written"]
    for k in ("kl_mixed", "kl_uniform"):
        assert s["fallback"][k] == pytest.approx(w["fallback"][k], rel=1e-4)
    da = json.loads((tmp_path / "s" / "allocation.json").read_text())["units"]
    db = json.loads((tmp_path / "w" / "allocation.json").read_text())["units"]
    for ua, ub in zip(da, db):
        for c in ua["delta"]:
            assert ua["delta"][c] == pytest.approx(ub["delta"][c], rel=1e-3, abs=1e-6)
    a = {k: v for f in sorted((tmp_path / "s").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted((tmp_path / "w").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".")]


def test_kl_swap_bad_input(hot_dir, tmp_path, capsys):
    """RTN with kl-swap: one line, exit 2, nothing written. Red if it ran (the probe is GPTQ's)."""
    out = tmp_path / "bad"
    code = _run(hot_dir, out, 3.5, "--method", "rtn")
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and "kl-swap" in err and "gptq" in err, err


def test_held_apart_parts_share_no_window(tiny_tokenizer):
    """kl-swap's sequences (part 1) and the fallback check's (part 0) are disjoint. Red if both drew the
    same offset."""
    a, how_a = held_apart(tiny_tokenizer, "bundled:brown-calib", 3, 32, 0, 4, part=0)
    b, how_b = held_apart(tiny_tokenizer, "bundled:brown-calib", 3, 32, 0, 4, part=1)
    assert "disjoint" in how_a and "disjoint" in how_b and how_a != how_b
    assert not any(torch.equal(x, y) for x in a.input_ids for y in b.input_ids)
