"""Bits per unit under an average-bits budget: a multiple-choice knapsack.

Run it on a sensitivity table::

    from compress.quant.allocate import Unit, allocate_bits, plot_allocation, uniform_avg_bits
    units = [Unit("model.layers.0", n_weights=n0, delta={2: 3.1, 3: 0.9, 4: 0.2, 8: 0.0}), ...]
    budget = uniform_avg_bits(units, bits=4, group_size=128)   # same size as uniform 4-bit
    alloc = allocate_bits(units, budget, group_size=128)
    plot_allocation(alloc, "bits.png")

A unit is what gets one bit width: a whole decoder layer, or a fused group such as
{q,k,v}, o, {gate,up}, down (never different bits inside a fused group). Its cost at
``b`` bits, counting the GPTQ scale (float16) and packed zero point (``b`` bits) stored
per output row and group, is

    C_u(b) = n_u·b + g_u·(16 + b) = n_u·(b + (16 + b)/gs)     [bits]

with n_u its number of weights and g_u = n_u/gs its number of (group, output row)
pairs; for gs = -1 (one group per row) g_u is the total number of output rows of the
unit's linears and must be given. **Budget**: ``avg_bits`` is average bits per weight
*including* that overhead, i.e. the allocation satisfies Σ_u C_u(b_u) ≤ avg_bits·Σ_u n_u
(up to a 1e-12 relative float tolerance). Uniform 4-bit with gs=128 costs 4 + 20/128 =
4.15625 average bits; ``uniform_avg_bits`` computes it for a given unit table.

The solver minimises Σ_u Δ_u(b_u), with Δ_u(b) the measured sensitivity of unit u at
b bits (e.g. KL with only u quantized, or GPTQ's layer loss).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from compress.errors import LayercutError

_BUDGET_RTOL = 1e-12


@dataclass(frozen=True)
class Unit:
    """One allocation unit: ``delta[b]`` = sensitivity Δ_u(b) for each candidate bit width."""

    name: str
    n_weights: int
    delta: Mapping[int, float]
    n_groups: int | None = None  # (group, output row) pairs; default n_weights // group_size


@dataclass
class Allocation:
    """The chosen bits per unit (in input order) and what they cost / predict."""

    bits: dict[str, int]
    avg_bits: float  # achieved Σ C_u(b_u) / Σ n_u, overhead included
    budget_avg_bits: float  # the budget asked for, same units
    total_delta: float  # Σ Δ_u(b_u), the predicted damage
    total_cost_bits: int  # Σ C_u(b_u)
    method: str  # "dp-exact", "dp-rounded" or "lagrangian"
    n_weights: dict[str, int] = field(default_factory=dict)

    def histogram(self) -> dict[int, int]:
        """How many units got each bit width."""
        out: dict[int, int] = {}
        for b in self.bits.values():
            out[b] = out.get(b, 0) + 1
        return dict(sorted(out.items()))


def unit_cost(n_weights: int, bits: int, group_size: int, n_groups: int | None = None) -> int:
    """C(b) = n·b + g·(16 + b) bits for a unit of ``n_weights`` weights (see module doc)."""
    if n_groups is None:
        if group_size <= 0:
            raise LayercutError("allocate: with group_size=-1 each unit needs n_groups (its output rows)")
        if n_weights % group_size:
            raise LayercutError(f"allocate: n_weights={n_weights} is not a multiple of group_size={group_size}")
        n_groups = n_weights // group_size
    return n_weights * bits + n_groups * (16 + bits)


def uniform_avg_bits(units: Sequence[Unit], bits: int, group_size: int) -> float:
    """Average bits per weight (overhead included) of giving every unit ``bits``."""
    total = sum(unit_cost(u.n_weights, bits, group_size, u.n_groups) for u in units)
    return total / sum(u.n_weights for u in units)


# ----------------------------------------------------------------------- validation


def _table(
    units: Sequence[Unit], candidates: Sequence[int] | None, group_size: int
) -> tuple[list[int], np.ndarray, list[list[int]]]:
    """Check the units; return (candidate bits ascending, Δ [U, K] float64, costs [U][K] int)."""
    if len(units) == 0:
        raise LayercutError("allocate: no units to allocate bits to")
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise LayercutError("allocate: unit names must be unique")
    cands = sorted(set(candidates if candidates is not None else units[0].delta))
    if not cands or any((not isinstance(b, int)) or b <= 0 for b in cands):
        raise LayercutError(f"allocate: candidate bits must be positive integers, got {cands}")
    delta = np.empty((len(units), len(cands)))
    costs: list[list[int]] = []
    for i, u in enumerate(units):
        if u.n_weights <= 0:
            raise LayercutError(f"allocate: unit {u.name!r} has n_weights={u.n_weights}")
        missing = [b for b in cands if b not in u.delta]
        if missing:
            raise LayercutError(f"allocate: unit {u.name!r} has no sensitivity for bits {missing}")
        for k, b in enumerate(cands):
            v = float(u.delta[b])
            if not math.isfinite(v):
                raise LayercutError(f"allocate: sensitivity of unit {u.name!r} at {b} bits is {v}")
            delta[i, k] = v
        costs.append([unit_cost(u.n_weights, b, group_size, u.n_groups) for b in cands])
    return cands, delta, costs


def _budget_bits(avg_bits: float, n_total: int) -> int:
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
    candidates: Sequence[int] | None = None,
    method: str = "dp",
    max_cells: int = 100_000,
) -> Allocation:
    """Choose b_u ∈ ``candidates`` per unit minimising Σ Δ_u(b_u) s.t. Σ C_u(b_u) ≤ avg_bits·Σ n_u.

    ``candidates`` defaults to the bit widths of the first unit's ``delta``; every unit
    must give Δ for each. ``method``: "dp" (exact when the gcd-reduced spare budget fits
    in ``max_cells`` cells, else provably near-exact — see ``_solve_dp``) or
    "lagrangian" (bisection on the multiplier + greedy fill, for very large tables).
    Raises ``LayercutError`` on empty/invalid units, non-finite Δ, or a budget below the
    cost of giving every unit the fewest candidate bits.
    """
    cands, delta, costs = _table(units, candidates, group_size)
    n_total = sum(u.n_weights for u in units)
    budget = _budget_bits(avg_bits, n_total)
    floor_cost = sum(min(row) for row in costs)
    if budget < floor_cost:
        raise LayercutError(
            f"allocate: budget of {avg_bits:.4f} average bits is below the cheapest allocation "
            f"({floor_cost / n_total:.4f} average bits with every unit at {cands[0]} bits, gs={group_size})"
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
    return Allocation(
        bits={u.name: cands[k] for u, k in zip(units, picks)},
        avg_bits=total_cost / n_total,
        budget_avg_bits=float(avg_bits),
        total_delta=float(sum(delta[u, k] for u, k in enumerate(picks))),
        total_cost_bits=total_cost,
        method=used,
        n_weights={u.name: u.n_weights for u in units},
    )


def plot_allocation(alloc: Allocation, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG bar chart of the bits of each unit, with the achieved average as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(alloc.bits)
    bits = [alloc.bits[n] for n in names]
    fig = Figure(figsize=(min(16.0, max(6.0, 0.18 * len(names) + 2)), 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(len(names)), bits, color="tab:blue")
    ax.axhline(alloc.avg_bits, color="tab:red", ls="--", lw=1, label=f"average {alloc.avg_bits:.3f} bits (incl. scales)")
    ax.set_xlabel("unit")
    ax.set_ylabel("bits")
    ax.set_yticks(sorted(set(bits)))
    ax.set_ylim(0, max(bits) * 1.3)  # headroom for the legend
    if len(names) <= 48:
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    ax.set_title(title or f"bit allocation ({alloc.method}), predicted Δ = {alloc.total_delta:.4g}")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
