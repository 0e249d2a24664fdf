"""Recipes: strict validation with useful messages, stage order, round trip, one definition with the CLI."""

from __future__ import annotations

import argparse
import typing

import pytest
import yaml

from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.config import PruneConfig as PruneStage
from layercut.compress.eval.config import EvalConfig as EvalStage
from layercut.compress.select.config import ScoreConfig as ScoreStage
from layercut.compress.workflow.recipe import STAGE_TYPES, Recipe, check_stage_order, load_recipe
from layercut.export.config import ExportConfig as ExportStage

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
    assert "stages[0].prune: unknown key 'replce', did you mean 'replace'? (allowed: " in msg
    for key in PruneStage.option_names():
        assert key in msg
    msg = bad({**BASE, "modle": "x"})
    assert "unknown key 'modle', did you mean 'model'? (allowed: version, model, name, seed, trust_remote_code, " \
        "target, stages)" in msg
    assert "unknown key 'stage'" in bad(with_stages({"eval": {"stage": "eval"}}))
    assert "unknown key 'group_szie', did you mean 'group_size'?" in bad(with_stages({"quantize": {"group_szie": 64}}))
    assert "unknown key 'xyzzy' (allowed:" in bad(with_stages({"export": {"xyzzy": 1}}))  # nothing close: no guess
    assert "unknown stage 'quantise', did you mean 'quantize'?" in bad(with_stages({"quantise": {"bits": 4}}))


def test_wrong_types_are_not_coerced():
    assert "stages[0].eval.max_tokens: Input should be a valid integer (got '512')" in \
        bad(with_stages({"eval": {"max_tokens": "512"}}))
    assert "seed: Input should be a valid integer" in bad({**BASE, "seed": "0"})
    assert "stages[0].export.dequantize: Input should be a valid boolean" in \
        bad(with_stages({"export": {"dequantize": "yes"}}))
    assert "stages[0].heal.steps must be >= 1 (got 0)" in bad(with_stages({"prune": {"layers": [3]}},
                                                                        {"heal": {"steps": 0}})).replace("[1]", "[0]")
    assert "stages[0].quantize.save_dtype: Input should be 'bf16', 'fp16' or 'fp32' (got 'int7')" in \
        bad(with_stages({"quantize": {"bits": 4, "save_dtype": "int7"}}))
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
    assert "compare with a reference model" in bad(with_stages({"eval": {"reference": None, "max_kl": 0.1}}))
    assert "compare with a reference model" in bad(with_stages({"eval": {"reference": False, "max_kl": 0.1}}))
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


# CLI options that belong to one invocation (files, output format), not to the stage's work.
_CLI_ONLY = {"model", "output", "json", "trust_remote_code", "plot", "overwrite", "dry_run", "help"}


@pytest.mark.parametrize("name", list(STAGE_TYPES))
def test_cli_flags_are_the_config_fields(name):
    """Each stage command's flags are generated from the same class the recipe validates against:
    the same names, choices and defaults (shown in the help), and the parsed flags build that class."""
    from layercut.compress.workflow.cli import build_parser
    from layercut.compress.workflow.stages.flags import _members, cli_default, config_from_args

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    actions = {a.dest: a for a in sub._actions}
    cls = STAGE_TYPES[name]
    assert set(actions) - _CLI_ONLY == set(cls.option_names())
    help_text = sub.format_help()
    for key in cls.option_names():
        action, field = actions[key], cls.model_fields[key]
        assert f"--{key.replace('_', '-')}" in action.option_strings
        assert field.description and action.help.startswith(field.description.split(",")[0].replace("%", "%%"))
        assert "(default: " in action.help, key  # every flag shows its default
        members = _members(field.annotation)
        if action.choices is not None:
            assert tuple(action.choices) == typing.get_args(members[0])
    assert "examples:" in help_text and f"layercut {name} " in help_text.split("examples:")[1]
    # a parsed command line builds the config: flags not given take the config's (or CLI's) defaults
    model = ["x"] + (["-o", "out"] if any(a.required for a in sub._actions if a.dest == "output") else [])
    given = {"quantize": {"bits": 4}, "prune": {"layers": "1"}}.get(name, {})
    args = sub.parse_args(model + [x for k, v in given.items() for x in (f"--{k}", str(v))])
    config = config_from_args(cls, args)
    assert {k: getattr(config, k) for k in cls.option_names()} == \
        {k: given.get(k, cli_default(cls, k)) for k in cls.option_names()}


def test_flags_round_trip_every_kind_of_field():
    """A command line of every field kind gives the config a recipe would: ints, floats, lists, Literals,
    bools (--x/--no-x), percentages."""
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.cli import build_parser
    from layercut.compress.workflow.stages.flags import config_from_args

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    args = sub["quantize"].parse_args(["m", "-o", "o", "--avg-bits", "3.5", "--candidates", "3,4", "--no-act-order",
                                       "--sym", "--unit", "group", "--group-size", "-1", "--save-dtype", "bf16"])
    cfg = config_from_args(QuantizeConfig, args)
    assert cfg == QuantizeConfig(avg_bits=3.5, candidates="3,4", act_order=False, sym=True, unit="group",
                                 group_size=-1, save_dtype="bf16")
    args = sub["prune"].parse_args(["m", "-o", "o", "--drop", "25%", "--select", "angular"])
    assert config_from_args(STAGE_TYPES["prune"], args).drop == "25%"
    args = sub["prune"].parse_args(["m", "-o", "o", "--drop", "3", "--select", "angular"])
    assert config_from_args(STAGE_TYPES["prune"], args).drop == 3
    args = sub["eval"].parse_args(["m", "--max-ppl-increase", "0.05", "--reference", "r"])
    assert config_from_args(STAGE_TYPES["eval"], args).max_ppl_increase == 0.05
    # eval's reference: the recipe's source model in a recipe, none on the command line
    assert STAGE_TYPES["eval"]().reference == "source"
    assert config_from_args(STAGE_TYPES["eval"], sub["eval"].parse_args(["m"])).reference is None
    with pytest.raises(LayercutError, match=r"^--group-size must be -1 \(one group per row\) or positive"):
        config_from_args(QuantizeConfig, sub["quantize"].parse_args(["m", "-o", "o", "--bits", "4",
                                                                     "--group-size", "0"]))
    with pytest.raises(LayercutError, match=r"^--sensitivity-samples must be >= 1 \(got 0\)"):
        config_from_args(QuantizeConfig, sub["quantize"].parse_args(["m", "-o", "o", "--bits", "4",
                                                                     "--sensitivity-samples", "0"]))


def test_recipe_seed_reaches_the_stages():
    recipe = Recipe.from_dict({**BASE, "seed": 7, "stages": [{"prune": {"layers": [3]}}, "heal",
                                                             {"quantize": {"bits": 4, "seed": 3}}]})
    assert [getattr(s, "seed", None) for s in recipe.stages] == [None, 7, 3]
    built = Recipe(model="m", seed=5, stages=[PruneStage(layers=[3]), STAGE_TYPES["heal"]()])
    assert built.stages[1].seed == 5
    assert Recipe.from_dict(yaml.safe_load(built.to_yaml())) == built


def test_old_spellings_still_load():
    """``batch`` (heal, now batch_size) and eval's ``reference: true/false`` from older recipes."""
    recipe = Recipe.from_dict(with_stages({"prune": {"layers": [3]}}, {"heal": {"batch": 2}},
                                          {"eval": {"reference": False}}, {"eval": {"reference": True}}))
    assert recipe.stages[1].batch_size == 2
    assert recipe.stages[2].reference is None and recipe.stages[3].reference == "source"


def test_score_stage_methods():
    assert ScoreStage(method="angular,block-influence").method == "angular,block-influence"
    with pytest.raises(ValueError, match="unknown score method 'nope'"):
        ScoreStage(method=["angular", "nope"])


def test_quantize_stage_checks():
    from layercut.compress.quant.config import QuantizeConfig as QuantizeStage
    from layercut.compress.quant.search.sensitivity import METHODS

    # the proxies sensitivity.py measures, plus kl-swap (measured in quant/search/swap.py)
    assert set(QuantizeStage.model_fields["sensitivity"].annotation.__args__) == set(METHODS) | {"kl-swap"}

    assert QuantizeStage(avg_bits=4.5, candidates="3,4,8").candidate_list() == [3, 4, 8]
    for kwargs, needle in [({}, "exactly one of bits"), ({"bits": 4, "avg_bits": 4.0}, "exactly one of bits"),
                           ({"bits": 5}, "bits must be one of"), ({"avg_bits": 4.0, "candidates": [3, 7]}, "candidates"),
                           ({"bits": 4, "sensitivity": "vibes"}, "Input should be 'loss', 'output'"),
                           ({"bits": 4, "group_size": 0}, "group_size")]:
        with pytest.raises(ValueError, match=needle):
            QuantizeStage(**kwargs)


def test_bundled_recipes_validate():
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.version == 1 and (recipe.stages or recipe.target)
    fast = load_recipe(recipes[0].with_name("smollm2-fast.yaml"))
    assert not fast.stages and fast.target.min_speedup > 1  # the speed-target example: depth must pay
    demo = load_recipe(recipes[0].with_name("smollm2-demo.yaml"))
    assert [s.stage for s in demo.stages] == ["quantize", "heal", "export", "eval"]
    assert demo.model == "bundled:smollm2-135m" and demo.stages[1].method == "scales"
    # off the bundled model's own Q4_1 grid (4-bit g32); its baseline is the same quantize stage alone
    assert demo.stages[0].group_size != 32
    plain = load_recipe(recipes[0].with_name("smollm2-4bit.yaml"))
    assert [s.stage for s in plain.stages] == ["quantize", "export", "eval"] and plain.stages[0] == demo.stages[0]
    assert plain.stages[-1] == demo.stages[-1]
    # below 4 bits: the demo's heal and eval on a block-tuned 3-bit quantize at the demo's group size
    three = load_recipe(recipes[0].with_name("smollm2-3bit.yaml"))
    assert [s.stage for s in three.stages] == ["quantize", "heal", "export", "eval"]
    q3 = three.stages[0]
    assert q3.bits == 3 and q3.block_tune and q3.group_size == demo.stages[0].group_size
    assert q3.samples == 256 and q3.seq_len == 128  # the calibration its header's figures were measured at
    assert q3.block_tune_lr == 0.01  # ... and the step size
    assert three.stages[1] == demo.stages[1] and three.stages[-1] == demo.stages[-1]
    former = load_recipe(recipes[0].with_name("smollm2-prune-heal.yaml"))
    assert [s.stage for s in former.stages] == ["prune", "heal", "quantize", "export", "eval"]
    assert former.stages[0].replace == "lstsq" and former.stages[0].drop >= 2 and former.stages[2].group_size != 32
    aggressive = load_recipe(recipes[0].with_name("smollm2-aggressive.yaml"))
    assert [s.stage for s in aggressive.stages] == [s.stage for s in former.stages]
    assert aggressive.stages[0].drop == "25%" and "aggressive" in aggressive.name


def test_flag_generation_from_a_new_config():
    """Adding an option is one field: its flag, choices, help, default and short alias follow."""
    from typing import Literal

    from pydantic import Field

    from layercut.compress.options import StageConfig
    from layercut.compress.workflow.stages.flags import add_config_args, config_from_args

    class NewConfig(StageConfig):
        stage: Literal["new"] = "new"
        group_size: int = Field(64, ge=1, description="columns per group", json_schema_extra={"short": "-g"})
        mode: Literal["fast", "exact"] = Field("fast", description="how to solve")
        keep: bool = Field(True, description="keep the input")
        limit: str | float | None = Field(None, description="a number or a percentage")

    parser = argparse.ArgumentParser()
    add_config_args(parser, NewConfig)
    text = " ".join(parser.format_help().split())
    assert "-g N, --group-size N columns per group (default: 64)" in text
    assert "--mode {fast,exact} how to solve (default: fast)" in text and "--keep, --no-keep" in text
    assert config_from_args(NewConfig, parser.parse_args(["-g", "32", "--no-keep", "--limit", "5%"])) == \
        NewConfig(group_size=32, keep=False, limit="5%")
    assert config_from_args(NewConfig, parser.parse_args(["--limit", "0.5"])).limit == 0.5
    with pytest.raises(LayercutError, match=r"^--group-size must be >= 1 \(got 0\)$"):
        config_from_args(NewConfig, parser.parse_args(["--group-size", "0"]))


def test_recipe_imports_no_stage_module():
    """Each stage config lives beside its algorithm (stages.CONFIGS): reading a recipe loads no stage module."""
    import subprocess
    import sys

    code = ("import sys, layercut.compress.workflow.recipe; "
            "print(sorted(m for m in sys.modules if m.startswith('layercut.compress.workflow.stages.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_quantize_help_shows_the_everyday_options_first():
    """`quantize --help`: at most 15 options before the advanced group, every option still listed."""
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.stages.flags import add_config_args

    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--output")
    add_config_args(parser, QuantizeConfig)
    text = parser.format_help()
    main, _, advanced = text.split("options:", 1)[1].partition("advanced options:")
    assert advanced, "no advanced group"

    def flags(part: str) -> set[str]:
        lines = [line.split()[:2] for line in part.splitlines() if line.startswith("  -")]
        return {w.rstrip(",") for ws in lines for w in ws if w.startswith("--")}

    first = [line for line in main.splitlines() if line.startswith("  -")]
    assert len(first) <= 15 - 4, first  # the CLI adds --overwrite, --dry-run, --trust-remote-code and --json
    for name in QuantizeConfig.option_names():
        flag = "--" + name.replace("_", "-")
        assert (flag in flags(main)) == (name in QuantizeConfig.everyday), name
        assert flag in flags(main) | flags(advanced), name


def test_everyday_must_name_options():
    from layercut.compress.workflow.stages.flags import add_config_args

    class Broken(ExportStage):
        everyday: typing.ClassVar[tuple[str, ...]] = ("no_such_option",)

    with pytest.raises(ValueError, match="no_such_option"):
        add_config_args(argparse.ArgumentParser(), Broken)


def test_quantize_presets_fill_only_what_is_not_given():
    """--preset sets its options unless given; a contradiction is refused."""
    from layercut.compress.quant.config import QuantizeConfig

    assert QuantizeConfig(bits=4).method == "gptq" and not QuantizeConfig(bits=4).block_tune
    assert QuantizeConfig(bits=4, preset="fast").method == "rtn"
    assert QuantizeConfig(bits=4, preset="best").block_tune
    assert QuantizeConfig(bits=4, preset="fast", method="gptq").method == "gptq"
    assert not QuantizeConfig(bits=4, preset="best", block_tune=False).block_tune
    with pytest.raises(ValueError, match="block_tune"):
        QuantizeConfig(bits=4, preset="fast", block_tune=True)
    with pytest.raises(ValueError, match="preset"):
        QuantizeConfig(bits=4, preset="fastest")
