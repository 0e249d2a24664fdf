"""A (bits, group size) per unit under an average-bits budget: a multiple-choice knapsack.

Run it on a sensitivity table::

    from layercut.compress.quant.search.allocate import Unit, allocate_bits, plot_allocation, uniform_avg_bits
    units = [Unit("model.layers.0.qkv", n_weights=n0, n_rows=r0, in_features=(576,),
                  delta={(3, 64): 0.9, (3, -1): 1.4, (4, 64): 0.2, (8, -1): 0.0}), ...]
    budget = uniform_avg_bits(units, (4, 64))          # same size as uniform 4-bit g64
    alloc = allocate_bits(units, budget)
    alloc.choice["model.layers.0.qkv"]                  # (4, 64)
    plot_allocation(alloc, "bits.png")

A unit is what gets one configuration: a whole decoder layer, or a fused group such as
{q,k,v}, o, {gate,up}, down (never different configurations inside a fused group). A
**candidate** is a pair c = (b, gs): b bits, ``gs`` columns per group (gs = -1: one group
per output row, "per channel"); :func:`parse_candidate` reads ``3g64`` / ``4ch`` / ``4``.
Its cost, counting the GPTQ scale (float16) and packed zero point (``b`` bits) stored per
(group, output row), is

    C_u(b, gs) = n_u·b + g_u(gs)·(16 + b)     [bits]

with n_u the unit's number of weights and g_u(gs) = Σ over its linears of
out_features·(in_features/gs) = n_u/gs, or Σ out_features (``n_rows``) for gs = -1. A
candidate is open to a unit only if ``gs`` divides the in_features of all its linears
(``Unit.in_features``); a unit's ``delta`` needs entries for exactly those. **Budget**:
``avg_bits`` is average bits per weight *including* that overhead, i.e. the allocation
satisfies Σ_u C_u(c_u) ≤ avg_bits·Σ_u n_u (up to a 1e-12 relative float tolerance).
Uniform 4-bit g128 costs 4 + 20/128 = 4.15625 average bits; :func:`uniform_avg_bits`
computes it for a unit table.

The solver minimises Σ_u Δ_u(c_u), with Δ_u(c) the measured sensitivity of unit u at c
(e.g. KL with only u changed, or GPTQ's layer loss). The older int-keyed form still works:
``delta={2: .., 4: ..}`` with ``allocate_bits(..., group_size=128)`` means the pairs
(b, 128), and then ``Allocation.bits`` is all a caller needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.search.candidates import (  # noqa: F401  (re-exported: the allocator's vocabulary)
    DEFAULT_CANDIDATES,
    LOW_BUDGET_CANDIDATES,
    TWO_BIT_CANDIDATES,
    Candidate,
    candidate_label,
    candidate_order,
    parse_candidate,
)

_BUDGET_RTOL = 1e-12


@dataclass(frozen=True)
class Unit:
    """One allocation unit: ``delta[c]`` = sensitivity Δ_u(c) for each candidate it can take.

    Keys are (bits, group size) pairs, or bare bits (then ``allocate_bits``'s
    ``group_size`` is meant). ``n_rows`` (Σ out_features) prices per-channel candidates;
    ``in_features`` (of each linear) decides which group sizes fit (empty: all do, as long
    as they divide ``n_weights``). ``n_groups``: the older form, the (group, row) pairs at
    the one group size in use (needed for gs = -1 when ``n_rows`` is not given).
    """

    name: str
    n_weights: int
    delta: Mapping
    n_groups: int | None = None
    n_rows: int | None = None
    in_features: tuple[int, ...] = ()

    def fits(self, group_size: int) -> bool:
        """Whether ``group_size`` divides the in_features of every linear of the unit."""
        return group_size == -1 or all(k % group_size == 0 for k in self.in_features)

    def cost(self, c: Candidate) -> int:
        """C_u(b, gs) in bits (see module doc)."""
        b, gs = c
        if gs == -1:
            return unit_cost(self.n_weights, b, -1, self.n_rows if self.n_rows is not None else self.n_groups)
        return unit_cost(self.n_weights, b, gs, self.n_groups if self.n_rows is None else None)


@dataclass
class Allocation:
    """The chosen configuration per unit (in input order) and what it costs / predicts."""

    bits: dict[str, int]
    avg_bits: float  # achieved Σ C_u(c_u) / Σ n_u, overhead included
    budget_avg_bits: float  # the budget asked for, same units
    total_delta: float  # Σ Δ_u(c_u), the predicted damage
    total_cost_bits: int  # Σ C_u(c_u)
    method: str  # "dp-exact", "dp-rounded" or "lagrangian"
    n_weights: dict[str, int] = field(default_factory=dict)
    group_size: dict[str, int] = field(default_factory=dict)  # per unit; -1 = per channel

    @property
    def choice(self) -> dict[str, Candidate]:
        """(bits, group size) per unit."""
        return {n: (b, self.group_size[n]) for n, b in self.bits.items()}

    def labels(self) -> dict[str, str]:
        """``"3g64"`` / ``"4ch"`` per unit."""
        return {n: candidate_label(c) for n, c in self.choice.items()}

    def histogram(self) -> dict[int, int]:
        """How many units got each bit width."""
        out: dict[int, int] = {}
        for b in self.bits.values():
            out[b] = out.get(b, 0) + 1
        return dict(sorted(out.items()))

    def pair_histogram(self) -> dict[str, int]:
        """How many units got each (bits, group size), e.g. ``{"3g64": 80, "4g64": 40}``."""
        out: dict[Candidate, int] = {}
        for c in self.choice.values():
            out[c] = out.get(c, 0) + 1
        return {candidate_label(c): out[c] for c in sorted(out, key=candidate_order)}


def unit_cost(n_weights: int, bits: int, group_size: int, n_groups: int | None = None) -> int:
    """C(b) = n·b + g·(16 + b) bits for a unit of ``n_weights`` weights (see module doc)."""
    if n_groups is None:
        if group_size <= 0:
            raise LayercutError("allocate: with group_size=-1 each unit needs n_groups (its output rows)")
        if n_weights % group_size:
            raise LayercutError(f"allocate: n_weights={n_weights} is not a multiple of group_size={group_size}")
        n_groups = n_weights // group_size
    return n_weights * bits + n_groups * (16 + bits)


def uniform_avg_bits(units: Sequence[Unit], bits: int | Candidate, group_size: int | None = None) -> float:
    """Average bits per weight (overhead included) of giving every unit ``bits`` — a bare
    width with ``group_size``, or a (bits, group size) pair. Raises if a unit cannot take it."""
    c = _pair(bits, group_size)
    bad = [u.name for u in units if not u.fits(c[1])]
    if bad:
        raise LayercutError(f"allocate: group size {c[1]} does not divide the input size of {bad[0]}")
    return sum(u.cost(c) for u in units) / sum(u.n_weights for u in units)


def uniform_candidates(units: Sequence[Unit], candidates: Sequence[Candidate]) -> dict[Candidate, float]:
    """Average bits of each candidate that every unit can take, uniformly (others left out)."""
    return {c: uniform_avg_bits(units, c) for c in sorted(set(candidates), key=candidate_order)
            if all(u.fits(c[1]) for u in units)}


def _pair(c: int | Candidate, group_size: int | None) -> Candidate:
    if isinstance(c, tuple):
        return int(c[0]), int(c[1])
    if group_size is None:
        raise LayercutError(f"allocate: bare bits {c} need a group_size")
    return int(c), int(group_size)


# ----------------------------------------------------------------------- validation


def require_fitting(cands: Sequence[Candidate], units: Sequence, who: str) -> None:
    """Refuse a candidate whose group size divides the input size of none of ``units`` (anything with ``fits(gs)``)."""
    for c in cands:
        if not any(u.fits(c[1]) for u in units):
            raise LayercutError(f"{who}: candidate {candidate_label(c)}: group size {c[1]} divides the input size "
                                "of no unit")


def _table(
    units: Sequence[Unit], candidates: Sequence[int | Candidate] | None, group_size: int
) -> tuple[list[Candidate], np.ndarray, list[list[int]]]:
    """Check the units; return (candidates in ascending order, Δ [U, K] float64 with +inf
    where a candidate does not fit the unit, costs [U][K] int).

    A candidate that does not fit a unit gets Δ = inf and the unit's cheapest fitting cost,
    so no solver ever picks it and the DP's extra costs stay non-negative.
    """
    if len(units) == 0:
        raise LayercutError("allocate: no units to allocate bits to")
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise LayercutError("allocate: unit names must be unique")
    raw = candidates if candidates is not None else [k for u in units for k in u.delta]
    if any(isinstance(b, bool) or not isinstance(b, (int, tuple)) for b in raw):
        raise LayercutError(f"allocate: candidates must be bits or (bits, group size) pairs, got {list(raw)}")
    cands = sorted({_pair(c, group_size) for c in raw}, key=candidate_order)
    if not cands or any(b <= 0 or (gs != -1 and gs <= 0) for b, gs in cands):
        raise LayercutError(f"allocate: candidate bits must be positive integers and group sizes -1 or positive, "
                            f"got {[candidate_label(c) for c in cands]}")
    require_fitting(cands, units, "allocate")
    delta = np.full((len(units), len(cands)), np.inf)
    costs: list[list[int]] = []
    for i, u in enumerate(units):
        if u.n_weights <= 0:
            raise LayercutError(f"allocate: unit {u.name!r} has n_weights={u.n_weights}")
        keyed = {_pair(k, group_size): v for k, v in u.delta.items()}
        fit = [k for k, c in enumerate(cands) if u.fits(c[1])]
        if not fit:
            raise LayercutError(f"allocate: no candidate group size divides the input sizes {u.in_features} "
                                f"of unit {u.name!r}")
        missing = [cands[k] for k in fit if cands[k] not in keyed]
        if missing:
            shown = [c[0] if c[1] == group_size else candidate_label(c) for c in missing]
            raise LayercutError(f"allocate: unit {u.name!r} has no sensitivity for bits {shown}")
        row: list[int | None] = [None] * len(cands)
        for k in fit:
            v = float(keyed[cands[k]])
            if not math.isfinite(v):
                raise LayercutError(f"allocate: sensitivity of unit {u.name!r} at {candidate_label(cands[k])} is {v}")
            delta[i, k] = v
            row[k] = u.cost(cands[k])
        cheapest = min(r for r in row if r is not None)
        costs.append([cheapest if r is None else r for r in row])
    return cands, delta, costs


def budget_bits(avg_bits: float, n_total: int) -> int:
    """Largest integer cost allowed by an average-bits budget (tiny relative slack for float)."""
    if not math.isfinite(avg_bits) or avg_bits <= 0:
        raise LayercutError(f"allocate: avg_bits must be a positive number, got {avg_bits}")
    exact = Fraction(avg_bits) * n_total
    return math.floor(exact + Fraction(_BUDGET_RTOL) * exact)


# ------------------------------------------------------------------------- solvers


def _solve_dp(delta: np.ndarray, extra: list[list[int]], spare: int, max_cells: int) -> tuple[list[int], str]:
    """Multiple-choice knapsack by DP over the extra cost above the all-cheapest choice.

    Extra costs are divided by their gcd, which keeps real model tables (many units of
    equal size) small enough to solve exactly. Otherwise costs are rounded *up* to a
    grid of ``spare/max_cells`` bits: the answer is still feasible, and at least as good
    as the exact optimum for the budget lowered by U grid cells (≤ U/max_cells of the
    spare budget).
    """
    U, K = delta.shape
    spare = min(spare, sum(max(e) for e in extra))  # budget beyond everything-at-max is moot
    g = 0
    for row in extra:
        for e in row:
            g = math.gcd(g, e)
    g = max(g, 1)
    if spare // g <= max_cells:
        step, method = g, "dp-exact"
        ext = [[e // g for e in row] for row in extra]
    else:
        step, method = -(-spare // max_cells), "dp-rounded"
        ext = [[-(-e // step) for e in row] for row in extra]
    cap = spare // step
    dp = np.zeros(cap + 1)  # dp[c]: least Σ Δ of the units so far with scaled extra cost ≤ c
    choice = np.zeros((U, cap + 1), dtype=np.int8)
    for u in range(U):
        new = np.full(cap + 1, np.inf)
        for k in range(K):  # ascending bits: on ties the cheaper choice is kept
            e = ext[u][k]
            if e > cap:
                continue
            cand = dp[: cap + 1 - e] + delta[u, k]
            better = cand < new[e:]
            new[e:][better] = cand[better]
            choice[u, e:][better] = k
        dp = new
    picks = [0] * U
    c = cap
    for u in range(U - 1, -1, -1):
        picks[u] = int(choice[u, c])
        c -= ext[u][picks[u]]
    return picks, method


def _solve_lagrangian(delta: np.ndarray, costs: np.ndarray, budget: int, iters: int = 100) -> list[int]:
    """Minimise Σ Δ + λ Σ C per unit, bisecting λ to the cheapest multiplier that fits,
    then spend the slack greedily (best Δ drop per extra bit first).

    The bisection result is optimal for the cost it spends (it lies on the lower convex
    hull); the greedy fill makes it near-optimal, not provably optimal, for the budget.
    """
    scale = costs.mean()
    c = costs / scale  # [U, K] normalised costs keep λ in a sane range

    def pick(lam: float) -> np.ndarray:
        return np.argmin(delta + lam * c, axis=1)

    def spent(p: np.ndarray) -> int:
        return int(sum(int(costs[u, k]) for u, k in enumerate(p)))

    p = pick(0.0)
    if spent(p) > budget:
        lo, hi = 0.0, 1.0
        while spent(pick(hi)) > budget:
            hi *= 2.0
            if hi > 1e300:
                raise LayercutError("allocate: Lagrangian bisection found no feasible multiplier")
        for _ in range(iters):
            mid = (lo + hi) / 2
            if spent(pick(mid)) > budget:
                lo = mid
            else:
                hi = mid
        p = pick(hi)
    left = budget - spent(p)
    while True:  # greedy upgrades into the slack
        best, best_rate = None, 0.0
        for u in range(delta.shape[0]):
            for k in range(delta.shape[1]):
                dc = int(costs[u, k]) - int(costs[u, p[u]])
                gain = delta[u, p[u]] - delta[u, k]
                if 0 < dc <= left and gain > 0 and gain / dc > best_rate:
                    best, best_rate = (u, k, dc), gain / dc
        if best is None:
            return [int(k) for k in p]
        u, k, dc = best
        p[u] = k
        left -= dc


def allocate_bits(
    units: Sequence[Unit],
    avg_bits: float,
    group_size: int = 128,
    candidates: Sequence[int | Candidate] | None = None,
    method: str = "dp",
    max_cells: int = 100_000,
) -> Allocation:
    """Choose c_u ∈ ``candidates`` per unit minimising Σ Δ_u(c_u) s.t. Σ C_u(c_u) ≤ avg_bits·Σ n_u.

    ``candidates``: (bits, group size) pairs, or bare bits meaning (bits, ``group_size``);
    default: every key of the units' ``delta``. Each unit only takes the candidates whose
    group size divides its linears' in_features, and must give Δ for each of those.
    ``method``: "dp" (exact when the gcd-reduced spare budget fits in ``max_cells`` cells,
    else provably near-exact — see ``_solve_dp``) or "lagrangian" (bisection on the
    multiplier + greedy fill, for very large tables). Raises ``LayercutError`` on
    empty/invalid units, non-finite Δ, a candidate no unit can take, or a budget below the
    cost of giving every unit its cheapest candidate.
    """
    cands, delta, costs = _table(units, candidates, group_size)
    n_total = sum(u.n_weights for u in units)
    budget = budget_bits(avg_bits, n_total)
    floor_cost = sum(min(row) for row in costs)
    if budget < floor_cost:
        raise LayercutError(
            f"allocate: budget of {avg_bits:.4f} average bits is below the cheapest allocation "
            f"({floor_cost / n_total:.4f} average bits with every unit at its cheapest candidate among "
            f"{', '.join(candidate_label(c) for c in cands)})"
        )
    if method == "dp":
        base = [min(row) for row in costs]
        extra = [[c - b for c in row] for row, b in zip(costs, base)]
        picks, used = _solve_dp(delta, extra, budget - floor_cost, max_cells)
    elif method == "lagrangian":
        picks, used = _solve_lagrangian(delta, np.array(costs, dtype=np.float64), budget), "lagrangian"
    else:
        raise LayercutError(f"allocate: method must be 'dp' or 'lagrangian', got {method!r}")
    total_cost = sum(costs[u][k] for u, k in enumerate(picks))
    assert total_cost <= budget, "allocator exceeded its budget"
    assert all(math.isfinite(delta[u, k]) for u, k in enumerate(picks)), "allocator chose a candidate that does not fit"
    return Allocation(
        bits={u.name: cands[k][0] for u, k in zip(units, picks)},
        avg_bits=total_cost / n_total,
        budget_avg_bits=float(avg_bits),
        total_delta=float(sum(delta[u, k] for u, k in enumerate(picks))),
        total_cost_bits=total_cost,
        method=used,
        n_weights={u.name: u.n_weights for u in units},
        group_size={u.name: cands[k][1] for u, k in zip(units, picks)},
    )


def plot_allocation(alloc: Allocation, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG bar chart: bar height = bits of each unit, colour = its group size, and
    the achieved average (scales included) as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(alloc.bits)
    bits = [alloc.bits[n] for n in names]
    sizes = [alloc.group_size.get(n, 0) for n in names]
    order = sorted(set(sizes), key=lambda g: (g == -1, g))  # small groups first, per channel last
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    colour = {g: palette[i % len(palette)] for i, g in enumerate(order)}
    fig = Figure(figsize=(min(16.0, max(6.0, 0.18 * len(names) + 2)), 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(len(names)), bits, color=[colour[g] for g in sizes])
    for g in order:  # one legend entry per group size
        label = "per channel" if g == -1 else (f"group size {g}" if g else "group size: n/a")
        ax.bar([0], [0], color=colour[g], label=label)
    ax.axhline(alloc.avg_bits, color="tab:red", ls="--", lw=1, label=f"average {alloc.avg_bits:.3f} bits (incl. scales)")
    ax.set_xlabel("unit")
    ax.set_ylabel("bits")
    ax.set_yticks(sorted(set(bits)))
    ax.set_ylim(0, max(bits) * 1.45)  # headroom for the legend
    if len(names) <= 48:
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    ax.set_title(title or f"bit allocation ({alloc.method}), predicted Δ = {alloc.total_delta:.4g}")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
