"""Every ``>>>`` example in layercut's own modules runs and gives what it says (doctest).

Modules are found by searching the source for ``>>>``, so a new docstring example is
tested without being listed here; the count check below fails if the search breaks.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("layercut", "compress", "calibrate", "heal", "export")


def modules_with_examples() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if ">>>" in path.read_text(encoding="utf-8"):
                rel = path.relative_to(REPO).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                names.append(".".join(parts if package == "layercut" else ("layercut", *parts)))
    return names


def test_examples_are_found():
    found = modules_with_examples()
    for name in ("layercut.compress.workflow.recipe", "layercut.compress.depth.config", "layercut.compress.quant.config",
                 "layercut.compress.workflow.stages.base", "layercut.calibrate.sources"):
        assert name in found


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (see output above)"
