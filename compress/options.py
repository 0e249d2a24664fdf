"""The one definition of a stage's options: a strict pydantic config, from which the CLI
flags (:mod:`layercut.compress.workflow.stages.flags`), the recipe keys (:mod:`layercut.compress.workflow.recipe`) and the
Python API (:mod:`layercut`) all come.

Usage::

    from layercut.compress.workflow.stages.prune import PruneConfig
    PruneConfig(drop=8, select="angular", replace="lstsq")     # validated now
    PruneConfig(replce="lstsq")      # ValueError: unknown key 'replce', did you mean 'replace'? ...

A field declares its type, default, bounds (``Field(ge=1)``) and a one-line
``description``; ``json_schema_extra`` may add ``short`` (a one-letter CLI alias),
``metavar`` and ``cli_default`` (the CLI's default where the recipe's differs: eval's
``reference`` is the recipe's source model in a run, nothing on the command line). No
type coercion (``"4"`` is not an int); unknown keys name the closest valid one. This
module is torch-free: ``layercut --help`` imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layercut.calibrate.sources import FIELD_KEYS, TextSource
from layercut.compress.core.devices import DEVICE_HELP, DEVICE_PATTERN
from layercut.compress.core.dtypes import Dtype as Dtype  # the option types live with the dtype table
from layercut.compress.core.dtypes import SaveDtype as SaveDtype
from layercut.compress.core.dtypes import option_dtype, option_name
from layercut.compress.core.errors import format_error, unknown_key_message
from layercut.compress.core.hfconfig import is_quantized

# a recipe's eval/heal stage compares with / distils from the recipe's model unless told otherwise
SOURCE = "source"


class StageConfig(BaseModel):
    """Base of every stage config: unknown keys are errors naming the closest key; no coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    # CLI help: one line, and one or two example command lines (set by each stage)
    help: ClassVar[str] = ""
    examples: ClassVar[tuple[str, ...]] = ()
    # The options `--help` lists first; when set, every other option goes under "advanced options"
    everyday: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def option_names(cls) -> list[str]:
        """The stage's options (the recipe keys; ``--`` + dashes on the CLI)."""
        return [k for k in cls.model_fields if k != "stage"]

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(unknown_key_message(str(unknown[0]), cls.option_names()))
        return data


def parse_fraction(value: str | float | int, what: str = "value") -> float:
    """A non-negative number or percentage.

    >>> parse_fraction("5%"), parse_fraction(0.05)
    (0.05, 0.05)
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number or a percentage like 5%, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
        except ValueError:
            raise ValueError(f"{what}: expected a number or a percentage like 5%, got '{value}'") from None
    else:
        number = float(value)
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"{what}: must be a finite number >= 0, got {value!r}")
    return number


def int_list(value: str | list[int], what: str) -> list[int]:
    """``"2,3,4"`` or ``[2, 3, 4]`` -> ``[2, 3, 4]``.

    >>> int_list("2, 3,4", "candidates")
    [2, 3, 4]
    """
    if isinstance(value, list):
        return list(value)
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected integers like 2,3,4,8, got '{value}'") from None


def torch_dtype(name: str, path=None):
    """A ``--dtype`` name as a torch dtype; ``auto`` = the checkpoint's own (fp32 if it names none,
    and for a quantized checkpoint stored in fp16)."""
    if name == "auto":
        name = "fp32"
        try:
            cfg = json.loads((Path(path) / "config.json").read_text()) if path is not None else {}
        except (OSError, ValueError):
            cfg = {}
        stored = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
        name = option_name(str(stored)) or "fp32"
        if name == "fp16" and is_quantized(cfg):
            # a GPTQ checkpoint stores its unquantized tensors in fp16 by convention, which says
            # nothing about the range its activations need (Gemma's overflow fp16): compute in fp32
            name = "fp32"
    return option_dtype(name)


# ---------------------------------------------------------------------------- text options
# A stage's text (score/prune/quantize: ``calib``, heal: ``data``) is a source string or, in a
# recipe, a list of TextSource entries (``{source, weight, text_field, messages_field,
# chat_template}``). The flat options below describe a string source; each stage declares
# them right after its text field (so --help lists them together) and mixes in TextOptions.
TextSpec = str | list[TextSource]
TEXT_SPEC_HELP = ("bundled:NAME, a .txt or .jsonl file, or hf:NAME[:CONFIG][@SPLIT] (e.g. @train[:1000]); "
                  "in a recipe also a list of {source, weight, text_field, messages_field, chat_template} "
                  "mixed by weight")


def text_field_option() -> Any:
    return Field(None, min_length=1, description="the text column of an hf: dataset or key of a .jsonl file "
                                                 "(none: text)", json_schema_extra={"metavar": "FIELD"})


def messages_field_option() -> Any:
    return Field(None, min_length=1, description="the conversations column or .jsonl key, each a list of "
                                                 "{role, content} (none: messages); needs --chat-template",
                 json_schema_extra={"metavar": "FIELD"})


def device_option() -> Any:
    return Field("auto", pattern=DEVICE_PATTERN, description=DEVICE_HELP, json_schema_extra={"metavar": "DEVICE"})


def chat_template_option() -> Any:
    return Field(False, description="render each conversation with the tokenizer's chat template")


class TextOptions(BaseModel):
    """Mixin of the stages that read text: checks the text options, and turns them into sources.

    ``text_option`` names the stage's text field; the stage declares it (``TextSpec``) and
    ``text_field`` / ``messages_field`` / ``chat_template`` (the ``*_option()`` fields above).
    """

    text_option: ClassVar[str] = "calib"

    @model_validator(mode="before")
    @classmethod
    def _text_entries(cls, data: Any) -> Any:
        """A recipe's list of mappings (or one mapping) -> TextSource entries, each error naming its entry."""
        name = cls.text_option
        if not isinstance(data, dict) or name not in data or isinstance(data[name], str):
            return data
        value = data[name]
        if not isinstance(value, (list, dict, TextSource)):
            raise ValueError(f"{name}: expected a source string or a list of sources (got {value!r})")
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError(f"{name}: the list of sources is empty")
        entries = []
        for i, item in enumerate(items):
            if not isinstance(item, (str, dict, TextSource)):
                raise ValueError(f"{name}[{i}]: expected a source string or a mapping with a source key "
                                 f"(got {item!r})")
            try:
                entries.append(item if isinstance(item, TextSource) else TextSource.model_validate(item))
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                if err["type"] == "missing":
                    raise ValueError(f"{name}[{i}]: missing required key '{err['loc'][-1]}'") from None
                raise ValueError(f"{name}[{i}]: {format_error(exc)}") from None
        return {**data, name: entries}

    @model_validator(mode="after")
    def _text_flags(self) -> Any:
        self.text_sources()
        return self

    def text_sources(self) -> list[TextSource]:
        """The stage's text as sources: the string with the flat options, or the list as given."""
        value = getattr(self, self.text_option)
        flat = {k: getattr(self, k) for k in FIELD_KEYS if getattr(self, k) not in (None, False)}
        if isinstance(value, list):
            if flat:
                raise ValueError(f"{', '.join(flat)}: these describe a single {self.text_option} source; in a "
                                 "list of sources, set them on each entry")
            return list(value)
        try:
            return [TextSource(source=value, **flat)]
        except ValidationError as exc:
                raise ValueError(format_error(exc)) from None

    def text_label(self) -> str | dict | list[dict]:
        """How reports name the text: the plain string as given, else the source(s) with their options."""
        value, sources = getattr(self, self.text_option), self.text_sources()
        if isinstance(value, str):
            return value if sources[0] == TextSource(source=value) else sources[0].model_dump(exclude_defaults=True)
        return [s.label() for s in sources]


# ---------------------------------------------------------------------------- streaming
STREAM_DTYPE_HELP = ("dtype the weights are read and written in (auto: the checkpoint's own); streamed, "
                     "each block computes in float32 on CPU")
WHOLE_MODEL_HELP = ("load the whole model in --dtype instead of streaming it one block at a time from the "
                    "checkpoint (streaming needs a family in layercut's table, and a dense checkpoint except in eval "
                    "and score, which stream GPTQ checkpoints too)")
