"""Bit allocation: exact against brute force, budget semantics, errors, plot."""

from __future__ import annotations

import itertools
import random

import pytest

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.search.allocate import (
    Allocation,
    Unit,
    allocate_bits,
    plot_allocation,
    uniform_avg_bits,
    unit_cost,
)

CANDS = (2, 3, 4, 8)


def _random_units(rng: random.Random, n_units: int, gs: int = 128) -> list[Unit]:
    units = []
    for i in range(n_units):
        n = gs * rng.randint(1, 64) * 16
        # decreasing in bits on average, but not always (a real table is noisy)
        base = rng.uniform(0.1, 5.0)
        delta = {b: base * 4.0 ** (-b) * rng.uniform(0.5, 1.5) * n / 1e4 for b in CANDS}
        units.append(Unit(f"u{i}", n, delta))
    return units


def _brute_force(units: list[Unit], budget_bits: int, gs: int) -> float:
    best = float("inf")
    for combo in itertools.product(CANDS, repeat=len(units)):
        cost = sum(unit_cost(u.n_weights, b, gs, u.n_groups) for u, b in zip(units, combo))
        if cost <= budget_bits:
            best = min(best, sum(u.delta[b] for u, b in zip(units, combo)))
    return best


def _cost(units: list[Unit], alloc: Allocation, gs: int) -> int:
    return sum(unit_cost(u.n_weights, alloc.bits[u.name], gs, u.n_groups) for u in units)


def test_cost_formula():
    n = 4096 * 4096
    assert unit_cost(n, 4, 128) == n * 4 + (n // 128) * 20 == n * (4 + 20 / 128)
    # gs = -1: one group per output row, so the unit must say how many rows it has
    assert unit_cost(n, 3, -1, n_groups=4096) == n * 3 + 4096 * 19
    with pytest.raises(LayercutError, match="n_groups"):
        unit_cost(n, 3, -1)
    units = [Unit("a", n, {4: 0.0})]
    assert uniform_avg_bits(units, 4, 128) == 4.15625


@pytest.mark.parametrize("seed", range(8))
def test_exact_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    gs = 128
    units = _random_units(rng, 5, gs)
    n_total = sum(u.n_weights for u in units)
    for avg in (2.2, 2.9, 3.5, uniform_avg_bits(units, 4, gs), 5.1, 8.2):
        alloc = allocate_bits(units, avg, group_size=gs)
        assert alloc.method == "dp-exact"
        budget_bits = int(avg * n_total)
        opt = _brute_force(units, budget_bits, gs)
        assert alloc.total_delta == pytest.approx(opt, rel=1e-12)
        assert _cost(units, alloc, gs) == alloc.total_cost_bits <= avg * n_total
        assert alloc.avg_bits == alloc.total_cost_bits / n_total <= avg


@pytest.mark.parametrize("seed", range(4))
def test_rounded_dp_is_feasible_and_near_exact(seed):
    rng = random.Random(100 + seed)
    gs = 128
    units = _random_units(rng, 6, gs)
    n_total = sum(u.n_weights for u in units)
    avg = 3.3
    alloc = allocate_bits(units, avg, group_size=gs, max_cells=20)
    assert alloc.method == "dp-rounded"
    assert alloc.total_cost_bits <= avg * n_total
    budget = int(avg * n_total)
    floor = sum(unit_cost(u.n_weights, 2, gs) for u in units)
    step = -(-(budget - floor) // 20)
    # guarantee: at least as good as the exact optimum with U grid cells less budget
    assert _brute_force(units, budget, gs) - 1e-12 <= alloc.total_delta
    assert alloc.total_delta <= _brute_force(units, budget - len(units) * step, gs) + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_lagrangian_is_feasible_and_close(seed):
    rng = random.Random(200 + seed)
    gs = 128
    units = _random_units(rng, 6, gs)
    n_total = sum(u.n_weights for u in units)
    for avg in (2.5, 3.4, 4.6):
        lag = allocate_bits(units, avg, group_size=gs, method="lagrangian")
        ex = allocate_bits(units, avg, group_size=gs)
        assert lag.method == "lagrangian"
        assert lag.total_cost_bits <= avg * n_total
        assert ex.total_delta - 1e-12 <= lag.total_delta <= 1.5 * ex.total_delta + 1e-12


@pytest.mark.parametrize("method", ["dp", "lagrangian"])
def test_uniform_budget_gives_uniform_bits(method):
    # Δ proportional to size and convex in bits: every unit faces the same trade-off, so
    # at exactly the size of uniform b bits the optimum is uniform b bits
    sizes = [128 * 128 * k for k in (1, 3, 3, 8, 2, 5, 5, 1)]
    units = [Unit(f"layer{i}", n, {b: n * 4.0 ** (-b) for b in CANDS}) for i, n in enumerate(sizes)]
    for b in (3, 4):
        alloc = allocate_bits(units, uniform_avg_bits(units, b, 128), group_size=128, method=method)
        assert set(alloc.bits.values()) == {b}
        assert alloc.avg_bits == uniform_avg_bits(units, b, 128)
        assert alloc.histogram() == {b: len(units)}


def test_allocation_beats_uniform_on_heterogeneous_sensitivities():
    n = 4096 * 4096
    sens = [0.1, 0.2, 5.0, 0.1, 3.0, 0.15, 0.1, 0.2]  # two fragile units
    units = [Unit(f"layer{i}", n, {b: s * 4.0 ** (-b) for b in CANDS}) for i, s in enumerate(sens)]
    budget = uniform_avg_bits(units, 4, 128)
    alloc = allocate_bits(units, budget, group_size=128)
    uniform_delta = sum(u.delta[4] for u in units)
    assert alloc.total_delta < 0.8 * uniform_delta
    robust = max(alloc.bits[f"layer{i}"] for i in (0, 1, 3, 5, 6, 7))
    assert alloc.bits["layer2"] == 8 and alloc.bits["layer4"] >= robust
    assert alloc.avg_bits <= budget


def test_model_sized_table_is_solved_exactly():
    # 32 decoder layers of a 7B llama as {qkv, o, gate_up, down} units: the gcd reduction
    # keeps the exact DP small (its speed is a benchmark's business, not a timed test's)
    h, f = 4096, 11008
    shapes = {"qkv": 3 * h * h, "o": h * h, "gate_up": 2 * f * h, "down": h * f}
    rng = random.Random(0)
    units = [
        Unit(f"model.layers.{i}.{k}", n, {b: rng.uniform(0.5, 2) * n * 4.0 ** (-b) for b in CANDS})
        for i in range(32)
        for k, n in shapes.items()
    ]
    alloc = allocate_bits(units, 3.5, group_size=128)
    assert alloc.method == "dp-exact"
    assert alloc.avg_bits <= 3.5
    # exact: no worse than the Lagrangian heuristic's feasible answer on the same table
    assert alloc.total_delta <= allocate_bits(units, 3.5, group_size=128, method="lagrangian").total_delta + 1e-9
    # gs = -1 with output rows as groups also works
    rows = {"qkv": 3 * h, "o": h, "gate_up": 2 * f, "down": h}
    units_pc = [Unit(u.name, u.n_weights, u.delta, n_groups=rows[u.name.rsplit(".", 1)[1]]) for u in units]
    assert allocate_bits(units_pc, 3.5, group_size=-1).avg_bits <= 3.5


def test_errors():
    units = [Unit("a", 1024, {2: 1.0, 4: 0.5}), Unit("b", 2048, {2: 2.0, 4: 0.1})]
    # all at 2 bits costs 2 + 18/128 = 2.140625 average bits
    assert allocate_bits(units, 2.15, group_size=128).bits == {"a": 2, "b": 2}
    with pytest.raises(LayercutError, match="below the cheapest"):
        allocate_bits(units, 2.1, group_size=128)
    with pytest.raises(LayercutError, match="no units"):
        allocate_bits([], 4.0)
    with pytest.raises(LayercutError, match="sensitivity of unit 'b'"):
        allocate_bits([units[0], Unit("b", 1024, {2: float("nan"), 4: 0.1})], 4.0)
    with pytest.raises(LayercutError, match="no sensitivity for bits"):
        allocate_bits([units[0], Unit("b", 1024, {2: 1.0})], 4.0)
    with pytest.raises(LayercutError, match="unique"):
        allocate_bits([units[0], units[0]], 4.0)
    with pytest.raises(LayercutError, match="method"):
        allocate_bits(units, 4.0, method="milp")
    with pytest.raises(LayercutError, match="n_groups"):
        allocate_bits(units, 4.0, group_size=-1)


def test_smoke_plot_writes_png(tmp_path):
    rng = random.Random(1)
    units = _random_units(rng, 12)
    alloc = allocate_bits(units, 3.6)
    out = plot_allocation(alloc, tmp_path / "bits.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
