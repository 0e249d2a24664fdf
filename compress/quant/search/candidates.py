"""The (bits, group size) candidates of mixed precision, as the options spell them: torch- and
numpy-free at import (the quantize options read them; ``layercut --help`` stays fast).

    from layercut.compress.quant.search.candidates import candidate_label, parse_candidate
    parse_candidate("3g64", 128), parse_candidate("8ch", 128), parse_candidate(4, 64)   # (3, 64) (8, -1) (4, 64)
    candidate_label((4, -1))                                                            # "4ch"

The allocator (:mod:`layercut.compress.quant.search.allocate`) prices and picks them.
"""

from __future__ import annotations

from collections.abc import Sequence

Candidate = tuple[int, int]  # (bits, group size); group size -1 = one group per output row
# what `layercut quantize --avg-bits` picks from by default; 2-bit only below a uniform 3ch budget
DEFAULT_CANDIDATES: tuple[Candidate, ...] = ((3, 128), (3, 64), (3, 32), (4, -1), (4, 128), (4, 64), (8, -1))
# 3-bit per channel joins the default set only when no other pair fits the budget uniformly: the loss
# measure prices it cheaply and the model's KL does not (benchmarks/quant.py rows mixed-*-no3ch)
LOW_BUDGET_CANDIDATES: tuple[Candidate, ...] = ((3, -1),)
TWO_BIT_CANDIDATES: tuple[Candidate, ...] = ((2, 64), (2, 32))


def parse_candidate(text: str | int | Sequence[int], default_group_size: int) -> Candidate:
    """``"3g64"`` -> (3, 64), ``"4ch"`` -> (4, -1), ``"4"`` or 4 -> (4, ``default_group_size``).

    >>> parse_candidate("3g64", 128), parse_candidate("8ch", 128), parse_candidate(4, 64)
    ((3, 64), (8, -1), (4, 64))
    """
    if isinstance(text, (tuple, list)) and len(text) == 2:
        return int(text[0]), int(text[1])
    if isinstance(text, bool):
        raise ValueError(f"candidate: expected e.g. 3g64, 4ch or 4, got {text!r}")
    if isinstance(text, int):
        return text, default_group_size
    s = str(text).strip().lower()
    try:
        if s.endswith("ch"):
            return int(s[:-2]), -1
        if "g" in s:
            b, _, g = s.partition("g")
            return int(b), int(g)
        return int(s), default_group_size
    except ValueError:
        raise ValueError(f"candidate: expected e.g. 3g64, 4ch or 4, got {text!r}") from None


def candidate_label(c: Candidate) -> str:
    """(3, 64) -> ``"3g64"``, (4, -1) -> ``"4ch"``."""
    return f"{c[0]}ch" if c[1] == -1 else f"{c[0]}g{c[1]}"


def candidate_order(c: Candidate) -> tuple[int, float]:
    """Ascending bits, then ascending overhead (per channel is the cheapest group size)."""
    return c[0], (0.0 if c[1] == -1 else 1.0 / c[1])
