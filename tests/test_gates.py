"""CI gates: ``layercut eval --max-ppl-increase/--max-kl`` exit 3 and name the failed gate."""

from __future__ import annotations

import json
import math

import pytest

from layercut.compress.core.errors import GateFailed, LayercutError
from layercut.compress.eval.gates import check_gates, enforce_gates, parse_limit
from layercut.compress.workflow.cli import main


def test_parse_limit():
    assert parse_limit("5%", "x") == pytest.approx(0.05)
    assert parse_limit("0.05", "x") == pytest.approx(0.05)
    assert parse_limit(0.1, "x") == 0.1 and parse_limit(None, "x") is None
    for bad in ("5x", "-1", "nan", "inf", ""):
        with pytest.raises(LayercutError):
            parse_limit(bad, "--max-kl")


def test_check_and_enforce():
    result = {"ppl": 21.0, "reference_ppl": 20.0, "kl": 0.2}
    gates = check_gates(result, max_ppl_increase=0.10, max_kl=0.1)
    assert [(g.name, g.passed) for g in gates] == [("max_ppl_increase", True), ("max_kl", False)]
    assert gates[0].value == pytest.approx(0.05)
    with pytest.raises(GateFailed, match=r"KL 0\.2 > limit 0\.1") as info:
        enforce_gates(result, gates)
    assert info.value.exit_code == 3 and info.value.payload["failed_gates"] == ["max_kl"]
    ok = enforce_gates(result, check_gates(result, max_ppl_increase=0.05))
    assert ok["gates_passed"] and ok["failed_gates"] == []
    nan = check_gates({"ppl": math.nan, "reference_ppl": 1.0, "kl": math.nan}, 1.0, 1.0)
    assert not any(g.passed for g in nan)  # NaN never passes


@pytest.fixture(scope="module")
def pruned(tiny_model_dir, tmp_path_factory):
    from layercut.compress.workflow.stages.prune import prune

    out = tmp_path_factory.mktemp("gates") / "pruned"
    prune(str(tiny_model_dir("llama")), out, layers=[4], progress=False)
    return out


def _eval(args, capsys) -> tuple[int, dict, str]:
    rc = main(["eval", *args, "--max-tokens", "128", "--ctx", "64", "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]), err


def test_eval_gate_fails_with_exit_3_and_names_the_gate(pruned, tiny_model_dir, capsys):
    ref = str(tiny_model_dir("llama"))
    rc, payload, err = _eval([str(pruned), "--reference", ref, "--max-ppl-increase", "1000%", "--max-kl", "0"],
                             capsys)
    assert rc == 3
    assert payload["failed_gates"] == ["max_kl"] and payload["gates_passed"] is False
    assert {g["name"]: g["passed"] for g in payload["gates"]} == {"max_ppl_increase": True, "max_kl": False}
    assert payload["kl"] > 0
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: quality gate failed: KL {payload['kl']:.4g} > limit 0"]


def test_eval_gates_pass(tiny_model_dir, capsys):
    ref = str(tiny_model_dir("llama"))
    rc, payload, _ = _eval([ref, "--reference", ref, "--max-ppl-increase", "5%", "--max-kl", "0.1"], capsys)
    assert rc == 0 and payload["gates_passed"] and payload["failed_gates"] == []
    assert payload["kl"] == pytest.approx(0.0, abs=1e-6)
