"""Recipes: one strict, versioned description of a whole compression run.

Usage::

    layercut run recipes/smollm2-demo.yaml -o runs/demo

    >>> from layercut.compress.workflow.recipe import Recipe, PruneConfig, EvalConfig
    >>> recipe = Recipe(model="bundled:smollm2-135m",
    ...                 stages=[PruneConfig(drop="25%", select="angular"), EvalConfig(max_tokens=1024)])
    >>> recipe.to_dict()["stages"][1]                            # every default filled in
    {'eval': {'text': ..., 'ctx': 512, 'max_tokens': 1024, 'batch_size': 4, 'device': 'auto', 'dtype': 'auto', 'whole_model': False, 'reference': 'source', ...}}
    >>> import yaml
    >>> Recipe.from_dict(yaml.safe_load(recipe.to_yaml())) == recipe   # the resolved recipe round-trips
    True

A recipe is YAML with a ``version``, a ``model`` and an ordered list of ``stages`` (or, instead
of stages, a ``target: {size: 40%, min_speedup: 1.25}`` that ``layercut run`` plans with
:mod:`layercut.compress.workflow.planner` and then runs; both together are refused); each
stage is a one-key mapping ``{name: {options}}`` whose options are the fields of the
stage's config class (:mod:`layercut.compress.workflow.stages`), the same as its CLI flags
(``--group-size`` becomes ``group_size``). Validation is strict (pydantic,
``extra="forbid"``, no type coercion): an unknown key names the closest valid key and
the keys allowed there, a wrong type names the field and the expected type, and a stage
order that makes no sense (quantize before prune, heal after quantize, anything but
eval after export) is refused. A stage with a ``seed`` option takes the recipe's seed
unless it sets its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from layercut.compress.core.errors import BOUNDS, LayercutError, closest, unknown_key_message
from layercut.compress.depth.config import PruneConfig
from layercut.compress.eval.config import EvalConfig
from layercut.compress.options import StageConfig
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.select.config import ScoreConfig
from layercut.compress.workflow.planner.config import PlanConfig
from layercut.compress.workflow.stages import config_types
from layercut.export.config import ExportConfig
from layercut.heal.config import HealConfig

RECIPE_VERSION = 1
STAGE_TYPES = config_types()

StageOptions = Annotated[
    ScoreConfig | PruneConfig | HealConfig | QuantizeConfig | ExportConfig | EvalConfig,
    Field(discriminator="stage"),
]

__all__ = [
    "Recipe", "StageOptions", "ScoreConfig", "PruneConfig", "HealConfig", "QuantizeConfig", "ExportConfig",
    "EvalConfig", "load_recipe", "RECIPE_VERSION", "STAGE_TYPES",
]


class Recipe(StageConfig):
    """The whole run: source model, seed and the ordered stages."""

    version: int = RECIPE_VERSION
    model: str = Field(min_length=1)
    name: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    # a size target instead of stages: `layercut run` plans them (layercut plan) and runs the plan's winner
    target: PlanConfig | None = None
    stages: list[StageOptions] = Field(default_factory=list)

    @classmethod
    def option_names(cls) -> list[str]:
        return list(cls.model_fields)

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != RECIPE_VERSION:
            raise ValueError(f"recipe version {v} is not supported (this layercut reads version {RECIPE_VERSION})")
        return v

    @field_validator("stages", mode="before")
    @classmethod
    def _stage_mappings(cls, items: Any, info: ValidationInfo) -> Any:
        """Turn YAML's ``- prune: {...}`` into ``{"stage": "prune", ...}`` for the tagged union,
        and give stages with a ``seed`` option the recipe's seed where they set none."""
        if not isinstance(items, list):
            return items
        names = ", ".join(STAGE_TYPES)
        seed = info.data.get("seed", 0)
        out = []
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                if "seed" in type(item).model_fields and "seed" not in item.model_fields_set:
                    item = item.model_copy(update={"seed": seed})
                out.append(item)
                continue
            if isinstance(item, str) and item in STAGE_TYPES:
                item = {item: None}
            if not isinstance(item, dict):
                raise ValueError(f"stages[{i}]: expected a mapping like '- prune: {{...}}' (stages: {names})")
            if "stage" in item:
                if item["stage"] not in STAGE_TYPES:
                    raise ValueError(f"stages[{i}]: {_unknown_stage(item['stage'])}")
                out.append(item)
                continue
            if len(item) != 1:
                raise ValueError(f"stages[{i}]: a stage is one key, its name (got {', '.join(map(str, item))}; "
                                 f"stages: {names})")
            (name, options), = item.items()
            if name not in STAGE_TYPES:
                raise ValueError(f"stages[{i}]: {_unknown_stage(name)}")
            if options is None:
                options = {}
            if not isinstance(options, dict):
                raise ValueError(f"stages[{i}].{name}: options must be a mapping, got {type(options).__name__}")
            if "stage" in options:
                raise ValueError(f"stages[{i}].{name}: " + unknown_key_message("stage", STAGE_TYPES[name].option_names()))
            if "seed" in STAGE_TYPES[name].model_fields and "seed" not in options:
                options = {**options, "seed": seed}
            out.append({"stage": name, **options})
        return out

    @model_validator(mode="after")
    def _stage_order(self) -> Recipe:
        if self.target is not None and self.stages:
            raise ValueError("target: the planner chooses the stages; give target or stages, not both")
        if self.target is None and not self.stages:
            raise ValueError("stages: the recipe has no stages (give stages, or a target: {size: 40%})")
        names = [s.stage for s in self.stages]
        for i, s in enumerate(self.stages):
            if s.stage == "export" and getattr(s, "format", "safetensors") != "safetensors":
                raise ValueError(f"stages[{i}].export: format '{s.format}' is for `layercut export` only (a recipe's "
                                 "eval reads the exported model); export the run's model afterwards with --format")
        check_stage_order([SCALE_HEAL if s.stage == "heal" and getattr(s, "method", "lora") == "scales" else n
                           for s, n in zip(self.stages, names)])
        for i, s in enumerate(self.stages):
            if s.stage == "export" and s.dequantize and "quantize" not in names[:i]:
                raise ValueError(f"stages[{i}].export: dequantize needs a quantize stage before it")
        return self

    # ---- round trip -------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain data in the YAML layout, every default filled in (the resolved recipe)."""
        data = self.model_dump(mode="json", exclude={"stages"} | (set() if self.target else {"target"}))
        data["stages"] = [{s.stage: s.model_dump(mode="json", exclude={"stage"})} for s in self.stages]
        return data

    def to_yaml(self) -> str:
        return yaml.dump(self.to_dict(), Dumper=_Dumper, sort_keys=False, width=100)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "recipe") -> Recipe:
        if not isinstance(data, dict):
            raise LayercutError(f"{origin}: a recipe is a mapping with version, model and stages "
                                f"(got {type(data).__name__})")
        if "version" not in data:
            raise LayercutError(f"{origin}: missing required key 'version' (this layercut reads version "
                                f"{RECIPE_VERSION})")
        if data.get("stages") == []:
            raise LayercutError(f"{origin}: stages: the recipe has no stages")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise LayercutError(f"{origin}: {format_validation_error(exc, data)}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> Recipe:
        return load_recipe(path)


def _unknown_stage(name: Any) -> str:
    near = closest(str(name), list(STAGE_TYPES))
    return f"unknown stage '{name}'" + (f", did you mean '{near}'?" if near else "") + \
        f" (stages: {', '.join(STAGE_TYPES)})"


SCALE_HEAL = "heal:scales"  # a heal stage with method scales, in check_stage_order's names


def check_stage_order(names: list[str]) -> None:
    """Refuse orders that cannot be right; raise ValueError naming the offending stages.

    score, prune and heal work on dense weights and may alternate (prune, heal, prune,
    heal); heal needs something to heal; quantize comes after all of them, once; only
    eval may follow export; eval may go anywhere. A heal with method scales (``SCALE_HEAL``)
    tunes a GPTQ checkpoint: it needs a quantize stage before it.
    """
    hints = {
        "prune": "prune dense weights first, then quantize",
        "heal": "LoRA healing needs dense weights: heal before quantize",
        "score": "score the dense model, before quantize",
        "quantize": "quantize once",
    }
    quantized = exported = None
    for i, name in enumerate(names):
        if name == SCALE_HEAL:  # tunes a GPTQ checkpoint: after quantize, before export
            if quantized is None:
                raise ValueError(f"stage order: 'heal' with method scales (stages[{i}]) tunes GPTQ scales: put it "
                                 "after a quantize stage")
            if exported is not None:
                raise ValueError(f"stage order: 'heal' (stages[{i}]) after export (stages[{exported}]); only eval "
                                 "may follow export")
            continue
        if exported is not None and name != "eval":
            raise ValueError(f"stage order: '{name}' (stages[{i}]) after export (stages[{exported}]); "
                             "only eval may follow export")
        if quantized is not None and name in hints:
            raise ValueError(f"stage order: '{name}' (stages[{i}]) after 'quantize' (stages[{quantized}]) "
                             f"is not allowed ({hints[name]})")
        if name == "heal" and "prune" not in names[:i]:
            raise ValueError(f"stage order: 'heal' (stages[{i}]) has nothing to heal: put a prune stage before it")
        if name == "quantize":
            quantized = i
        if name == "export":
            exported = i


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe file; every problem is one :class:`LayercutError` line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise LayercutError(f"recipe not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise LayercutError(f"{p}: invalid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise LayercutError(f"{p}: not a text file") from None
    if data is None:
        raise LayercutError(f"{p}: empty recipe (needs version, model and stages)")
    return Recipe.from_dict(data, origin=str(p))


def format_validation_error(exc: ValidationError, data: Any) -> str:
    """The first pydantic error as one line: ``stages[1].quantize.bits: <message>``."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = _loc_text(err["loc"], data)
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "missing":
        parent, _, key = loc.rpartition(".")
        msg, loc = f"missing required key '{key}'", parent
    elif err["type"] == "extra_forbidden":  # our before-validator normally catches these first
        parent, _, key = loc.rpartition(".")
        msg, loc = f"unknown key '{key}'", parent
    elif err["type"] in BOUNDS:  # "stages[0].heal.steps must be >= 1 (got 0)"
        op, key = BOUNDS[err["type"]]
        return f"{loc} must be {op} {err['ctx'][key]:g} (got {err['input']!r})"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {err['input']!r})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    prefix = f"{loc}: " if loc and not msg.startswith(loc) else ""
    return f"{prefix}{msg}{more}"


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of scalars which read better inline: ``bits: [2, 3, 4]``."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _loc_text(loc: tuple, data: Any) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{item}]"]
        elif item.startswith("function-") or item in ("model-validator",):
            continue
        else:
            parts.append(item)
    return ".".join(parts)
