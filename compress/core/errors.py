"""Errors that layercut reports to users as one clear line (see layercut.compress.workflow.cli), and the
helpers that word them: typo suggestions, flag names and the one pydantic-error formatter.
Torch- and pydantic-free at import time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class LayercutError(Exception):
    """A user-facing error: bad input, unsupported model, impossible request.

    The CLI prints ``error: <message>`` on one line and exits with ``exit_code``.
    """

    exit_code = 2


class GateFailed(LayercutError):
    """A quality gate (``--max-ppl-increase``, ``--max-kl``) failed."""

    exit_code = 3


# ----------------------------------------------------------------- suggestions and messages


def closest(word: str, options: list[str] | tuple[str, ...]) -> str | None:
    """The option nearest to a misspelt ``word`` (difflib ratio >= 0.6), or None."""
    import difflib

    found = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_key_message(key: str, allowed: list[str]) -> str:
    """``unknown key 'replce', did you mean 'replace'? (allowed: ...)``."""
    near = closest(key, allowed)
    hint = f", did you mean '{near}'?" if near else ""
    return f"unknown key '{key}'{hint} (allowed: {', '.join(allowed)})"


def flag_name(field: str) -> str:
    """A config field's command-line flag: ``group_size`` -> ``--group-size``."""
    return "--" + field.replace("_", "-")


# pydantic's bound error types: (operator, key of the bound in the error's ctx)
BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt")}


def format_error(exc: ValidationError, flags: list[str] | None = None) -> str:
    """The first pydantic error as one line naming the field; ``flags``: option names to spell as flags.

    The one pydantic-error formatter: the CLI, the recipe loader and the Python API all use it.
    """
    err = exc.errors(include_url=False)[0]
    parts = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    where = (flag_name(parts[-1]) if flags else ".".join(parts)) if parts else ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in BOUNDS and where:  # "steps must be >= 1 (got 0)"
        op, key = BOUNDS[err["type"]]
        return f"{where} must be {op} {err['ctx'][key]:g} (got {err['input']!r})"
    if "input" in err and err["type"] not in ("value_error", "assertion_error", "missing"):
        msg = f"{msg} (got {err['input']!r})"
    if flags:  # validators speak in recipe keys; on the command line name the flags
        msg = _keys_to_flags(msg, flags)
    return f"{where}: {msg}" if where and not msg.startswith(where) else msg


def _keys_to_flags(text: str, names: list[str]) -> str:
    import re

    first = text.split(" ", 1)[0].rstrip(":")
    if first in names:  # "candidates must be among ..." -> "--candidates must be among ..."
        text = flag_name(first) + text[len(first):]
    multi = sorted((n for n in names if "_" in n), key=len, reverse=True)
    if not multi:
        return text
    return re.sub(r"(?<![-\w])(" + "|".join(multi) + r")\b", lambda m: flag_name(m.group(1)), text)
