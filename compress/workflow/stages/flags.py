"""Command-line flags generated from a stage config, and configs built back from them.

Usage::

    parser = argparse.ArgumentParser()
    add_config_args(parser, QuantizeConfig)          # --bits, --avg-bits, --group-size, ...
    args = parser.parse_args(["--bits", "4"])
    config = config_from_args(QuantizeConfig, args)  # QuantizeConfig(bits=4), validated

Field ``group_size`` becomes ``--group-size``; a ``Literal`` gives choices; a bool gives
``--x/--no-x``; help is the field's description plus its default. Flags not given stay
out of the config, so the config's own defaults apply. Torch-free.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import ValidationError

from layercut.compress.core.errors import LayercutError, flag_name, format_error
from layercut.compress.options import StageConfig


def _members(annotation: Any) -> list[Any]:
    """The non-None members of an annotation (``int | str | None`` -> [int, str])."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _parser_for(members: list[Any]):
    """A str -> value converter: numbers first, then text (list[int] reads as a comma string)."""
    kinds = sorted((typing.get_origin(m) or m for m in members), key=lambda k: (k is not int, k is not float))

    def convert(text: str):
        for kind in kinds:
            if kind is int:
                try:
                    return int(text)
                except ValueError:
                    continue
            if kind is float:
                try:
                    return float(text)
                except ValueError:
                    continue
            if kind in (str, list):
                return text
        want = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")

    convert.__name__ = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
    return convert


def _show(value: Any) -> str:
    return _plain(value).replace("%", "%%")  # argparse %-formats help


def _plain(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def cli_default(cls: type[StageConfig], name: str) -> Any:
    field = cls.model_fields[name]
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra["cli_default"] if "cli_default" in extra else field.get_default(call_default_factory=True)


def add_config_args(parser: argparse.ArgumentParser, cls: type[StageConfig]) -> None:
    """One flag per field of ``cls`` (``stage`` excluded); defaults are left to the config. With
    ``cls.everyday`` set, the other options are listed under "advanced options"."""
    unknown = set(cls.everyday) - set(cls.option_names())
    if unknown:
        raise ValueError(f"{cls.__name__}.everyday names no option: {sorted(unknown)}")
    advanced = parser.add_argument_group("advanced options", "research knobs; the defaults were chosen on "
                                         "validation text") if cls.everyday else parser
    for name in cls.option_names():
        field = cls.model_fields[name]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        names = ([extra["short"]] if "short" in extra else []) + [flag_name(name)]
        members = _members(field.annotation)
        default = cli_default(cls, name)
        help_text = (field.description or name.replace("_", " ")).rstrip(".").replace("%", "%%")
        kw: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS)
        if members == [bool]:
            kw["action"] = argparse.BooleanOptionalAction
            kw["help"] = f"{help_text} (default: {_show(default)})"
        elif len(members) == 1 and typing.get_origin(members[0]) is Literal:
            choices = typing.get_args(members[0])
            kw.update(choices=choices, type=type(choices[0]), help=f"{help_text} (default: {_show(default)})")
        else:
            short = {int: "N", float: "X"}.get(members[0]) if len(members) == 1 else None
            kw.update(type=_parser_for(members), metavar=extra.get("metavar", short or name.upper()),
                      help=f"{help_text} (default: {_show(default)})")
        (parser if name in cls.everyday else advanced).add_argument(*names, **kw)


def config_from_args(cls: type[StageConfig], args: argparse.Namespace) -> StageConfig:
    """The config of the flags given (others at the CLI default); one-line LayercutError if invalid."""
    values = {}
    for name in cls.option_names():
        if name in vars(args):
            values[name] = getattr(args, name)
        elif cli_default(cls, name) != cls.model_fields[name].get_default(call_default_factory=True):
            values[name] = cli_default(cls, name)
    try:
        return cls(**values)
    except ValidationError as exc:
        raise LayercutError(format_error(exc, flags=cls.option_names())) from None
