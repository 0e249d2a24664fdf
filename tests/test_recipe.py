"""Recipes: strict validation with useful messages, stage order, round trip, CLI parity."""

from __future__ import annotations

import argparse

import pytest
import yaml

from compress.errors import LayercutError
from compress.recipe import STAGE_TYPES, Recipe, check_stage_order, load_recipe
from compress.recipe_stages import EvalStage, ExportStage, PruneStage, ScoreStage

BASE = {"version": 1, "model": "bundled:smollm2-135m",
        "stages": [{"prune": {"drop": "25%", "select": "block-influence", "replace": "lstsq"}}, "export",
                   {"eval": {"max_tokens": 512, "max_ppl_increase": "5%", "max_kl": 0.1}}]}


def bad(data: dict) -> str:
    with pytest.raises(LayercutError) as info:
        Recipe.from_dict(data)
    return str(info.value)


def with_stages(*stages) -> dict:
    return {**BASE, "stages": list(stages)}


def test_round_trip_and_python_build(tmp_path):
    recipe = Recipe.from_dict(BASE)
    text = recipe.to_yaml()
    assert text.startswith("version: 1\n")
    again = Recipe.from_dict(yaml.safe_load(text))
    assert again == recipe and again.to_yaml() == text
    built = Recipe(model="bundled:smollm2-135m",
                   stages=[PruneStage(drop="25%", select="block-influence", replace="lstsq"), ExportStage(),
                           EvalStage(max_tokens=512, max_ppl_increase="5%", max_kl=0.1)])
    assert built == recipe
    path = tmp_path / "r.yaml"
    path.write_text(text)
    assert load_recipe(path) == recipe
    # every default is filled in: the resolved recipe states everything the run used
    assert yaml.safe_load(text)["stages"][0]["prune"]["alpha"] == 1e-4


def test_unknown_key_names_key_and_allowed_keys():
    msg = bad(with_stages({"prune": {"drop": 2, "select": "angular", "replce": "lstsq"}}))
    assert "stages[0].prune: unknown key 'replce'" in msg
    for key in PruneStage.option_names():
        assert key in msg
    msg = bad({**BASE, "modle": "x"})
    assert "unknown key 'modle' (allowed: version, model, name, seed, trust_remote_code, stages)" in msg
    assert "unknown key 'stage'" in bad(with_stages({"eval": {"stage": "eval"}}))


def test_wrong_types_are_not_coerced():
    assert "stages[0].eval.max_tokens: Input should be a valid integer (got '512')" in \
        bad(with_stages({"eval": {"max_tokens": "512"}}))
    assert "seed: Input should be a valid integer" in bad({**BASE, "seed": "0"})
    assert "stages[0].export.dequantize: Input should be a valid boolean" in \
        bad(with_stages({"export": {"dequantize": "yes"}}))
    assert "options must be a mapping" in bad(with_stages({"export": [1, 2]}))


@pytest.mark.parametrize("order, needle", [
    (["quantize", "prune"], "'prune' (stages[1]) after 'quantize' (stages[0])"),
    (["prune", "quantize", "heal"], "heal before quantize"),
    (["prune", "quantize", "score"], "score the dense model"),
    (["heal"], "nothing to heal"),
    (["prune", "export", "prune"], "only eval may follow export"),
    (["prune", "quantize", "quantize"], "quantize once"),
])
def test_stage_order_refused(order, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        check_stage_order(order)


@pytest.mark.parametrize("order", [
    ["score", "prune", "heal", "quantize", "export", "eval"],
    ["eval", "prune", "eval", "heal", "prune", "heal", "quantize", "eval", "export", "eval"],
    ["quantize", "export"], ["export", "eval", "eval"], ["score", "score", "prune"],
    ["prune", "heal", "score", "prune", "heal"],
])
def test_stage_order_allowed(order):
    check_stage_order(order)


def test_order_error_in_recipe_and_other_problems():
    assert "stage order: 'prune' (stages[1]) after 'quantize' (stages[0]) is not allowed (prune dense weights " \
        "first, then quantize)" in bad(with_stages({"quantize": {"bits": 4}}, {"prune": {"layers": [3]}}))
    assert "version 2 is not supported" in bad({**BASE, "version": 2})
    assert "missing required key 'version'" in bad({k: v for k, v in BASE.items() if k != "version"})
    assert "missing required key 'model'" in bad({k: v for k, v in BASE.items() if k != "model"})
    assert "unknown stage 'squeeze' (stages: score, prune, heal, quantize, export, eval)" in \
        bad(with_stages({"squeeze": {}}))
    assert "no stages" in bad(with_stages())
    assert "a stage is one key" in bad(with_stages({"prune": {}, "export": {}}))
    assert "drop must be a count >= 1 or a percentage" in bad(with_stages({"prune": {"drop": "125%"}}))
    assert "max_ppl_increase: expected a number or a percentage" in \
        bad(with_stages({"eval": {"max_ppl_increase": "5x"}}))
    assert "set reference: true" in bad(with_stages({"eval": {"reference": False, "max_kl": 0.1}}))
    assert "give exactly one of select METHOD or layers LIST" in bad(with_stages({"prune": {"drop": 2}}))
    assert "stages[1].export: dequantize needs a quantize stage before it" in \
        bad(with_stages({"prune": {"layers": [3]}}, {"export": {"dequantize": True}}))


def test_load_recipe_file_errors(tmp_path):
    with pytest.raises(LayercutError, match="recipe not found"):
        load_recipe(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\nstages: [prune\n")
    with pytest.raises(LayercutError, match=r"invalid YAML at line \d+"):
        load_recipe(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- prune\n- export\n")
    with pytest.raises(LayercutError, match="a recipe is a mapping"):
        load_recipe(listy)


# CLI options that are about files/flags of one invocation, not about the stage's work.
_CLI_ONLY = {"model", "output", "json", "trust_remote_code", "plot", "overwrite", "no_card",
             "teacher", "resume", "checkpoint_every", "no_gradient_checkpointing"}
# Recipe spellings of CLI options: `card` = not --no-card, `gradient_checkpointing` = not
# --no-gradient-checkpointing, eval's `reference` is a bool (the recipe's source model).
_RECIPE_ONLY = {"eval": {"reference"}, "export": {"card"}, "heal": {"gradient_checkpointing"}}


@pytest.mark.parametrize("name", list(STAGE_TYPES))
def test_stage_options_match_cli(name):
    """Each stage has the same options as its CLI command (where that command exists)."""
    from compress.cli import COMMANDS, build_parser

    if f"compress.commands.{name}" not in COMMANDS:
        pytest.skip(f"no `layercut {name}` command in this build")
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    cli = {a.dest for a in sub._actions if a.dest != "help"} - _CLI_ONLY
    recipe = set(STAGE_TYPES[name].option_names()) - _RECIPE_ONLY.get(name, set())
    if name == "eval":
        cli.discard("reference")  # CLI: a path; recipe: bool (the recipe's source model)
    assert recipe == cli
    # ... and the same defaults (seed: the recipe's seed unless given)
    cli_defaults = {a.dest: a.default for a in sub._actions if a.dest in recipe and a.dest != "seed"}
    fields = STAGE_TYPES[name].model_fields
    assert {k: fields[k].get_default(call_default_factory=True) for k in cli_defaults} == cli_defaults


def test_score_stage_methods():
    assert ScoreStage(method="angular,block-influence").method == "angular,block-influence"
    with pytest.raises(ValueError, match="unknown score method 'nope'"):
        ScoreStage(method=["angular", "nope"])


def test_quantize_stage_checks():
    from compress.recipe_stages import QuantizeStage

    assert QuantizeStage(avg_bits=4.5, candidates="3,4,8").candidate_list() == [3, 4, 8]
    for kwargs, needle in [({}, "exactly one of bits"), ({"bits": 4, "avg_bits": 4.0}, "exactly one of bits"),
                           ({"bits": 5}, "bits must be one of"), ({"avg_bits": 4.0, "candidates": [3, 7]}, "candidates"),
                           ({"bits": 4, "sensitivity": "vibes"}, "unknown sensitivity"),
                           ({"bits": 4, "group_size": 0}, "group_size")]:
        with pytest.raises(ValueError, match=needle):
            QuantizeStage(**kwargs)


def test_bundled_recipes_validate():
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.version == 1 and recipe.stages
    demo = load_recipe(recipes[0].with_name("smollm2-demo.yaml"))
    assert [s.stage for s in demo.stages] == ["prune", "heal", "quantize", "export", "eval"]
    assert demo.model == "bundled:smollm2-135m" and demo.stages[0].replace == "lstsq"
