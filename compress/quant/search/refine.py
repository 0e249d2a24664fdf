"""The allocator's refinement round: re-measure each unit's neighbouring candidates at the operating point.

Used by ``layercut quantize MODEL --avg-bits X --refine`` (GPTQ with ``--sensitivity loss``; off by
default: on the validation text it moved 4-10 of 120 units and did not lower the KL,
``benchmarks/quant.py`` rows ``mixed-*-refine``)::

    refiner = Refiner(units, alloc_units, alloc, cands, cfg)
    result = quantize_model(model, calib, cfg, plan, probe=refiner.probe)   # the chosen allocation
    alloc2 = allocate_bits(refiner.refined(result), avg_bits, candidates=cands)
    # or all of it, re-quantizing when the allocation moved:
    alloc2, result, refined, info = refiner.round(result, avg_bits, quantize, restore)

The sensitivity pass measures every Δ_u(c) = ½ tr(ΔW H ΔWᵀ) with H from the *float* model's
inputs: every other unit unquantized. The quantize pass that follows runs at the operating
point: block l's Hessian comes from the inputs of blocks 0..l−1 quantized with the chosen
allocation, so every unit's loss is what it really costs there. At each fused group's turn,
before the chosen solve, :meth:`Refiner.probe` re-solves the candidates next to the unit's
choice (in cost order: the next cheaper and the next dearer candidate that fit) on that same
Hessian and keeps only their losses. :meth:`Refiner.refined` then builds the refined table per
unit: the chosen and neighbouring candidates take their losses at the operating point, and the
unit's other candidates are scaled by the same factor as its chosen one (new / old loss at the
choice), so all of a unit's entries stay on one scale. The DP is solved again on that table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import Tensor

from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.search.allocate import (
    Allocation,
    Candidate,
    Unit,
    allocate_bits,
    candidate_label,
)
from layercut.compress.quant.solve.linear import solve_group
from layercut.compress.quant.solve.settings import SolverConfig


def neighbours(unit: Unit, choice: Candidate, cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates next to ``choice`` in ``unit``'s cost order (one cheaper, one dearer, where they exist)."""
    fitting = sorted((c for c in cands if unit.fits(c[1])), key=lambda c: (unit.cost(c), c))
    k = fitting.index(choice)
    return [fitting[j] for j in (k - 1, k + 1) if 0 <= j < len(fitting)]


@dataclass
class Refiner:
    """Collects the neighbours' losses during the quantize pass of the chosen allocation."""

    units: Sequence  # layercut.compress.quant.search.sensitivity.AllocUnit, in forward order
    table: Sequence[Unit]  # the first table (the one ``alloc`` was solved on)
    alloc: Allocation
    cands: Sequence[Candidate]
    cfg: SolverConfig
    losses: dict[tuple[str, Candidate], float] = field(default_factory=dict)  # (linear, candidate) -> loss
    solves: int = 0
    probe_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._unit_of = {n: u.name for u in self.units for n in u.linears}
        by_name = {u.name: u for u in self.table}
        self._next = {u.name: neighbours(by_name[u.name], self.alloc.choice[u.name], self.cands) for u in self.units}

    def probe(self, names: Sequence[str], Ws: Sequence[Tensor], H: Tensor) -> None:
        """At a fused group's turn (``H`` from the quantized prefix; left unchanged): solve the
        neighbours of each member's unit and keep their losses."""
        t0 = time.perf_counter()
        wanted = sorted({c for n in names for c in self._next[self._unit_of[n]]})
        for c in wanted:
            fit = [i for i, n in enumerate(names) if c in self._next[self._unit_of[n]]]
            parts = solve_group([Ws[i] for i in fit], H, c[0], replace(self.cfg, group_size=c[1]))
            self.solves += 1
            for i, res in zip(fit, parts):
                self.losses[(names[i], c)] = res.loss
        self.probe_seconds += time.perf_counter() - t0

    def refined(self, result: QuantizeResult) -> list[Unit]:
        """The refined table (see module doc) from ``result``, the pass that ran :meth:`probe`."""
        out = []
        for au, u in zip(self.units, self.table):
            chosen = self.alloc.choice[u.name]
            now = float(sum(result.layers[n].loss for n in au.linears))
            old = u.delta[chosen]
            scale = now / old if old > 0 and math.isfinite(now) else 1.0
            delta = {c: v * scale for c, v in u.delta.items()}
            delta[chosen] = now
            for c in self._next[u.name]:
                delta[c] = float(sum(self.losses[(n, c)] for n in au.linears))
            out.append(replace(u, delta=delta))
        return out

    def summary(self, refined: Sequence[Unit], second: Allocation, requantize_seconds: float) -> dict:
        """What the round did, for the report and allocation.json: both allocations' predicted Δ
        on the refined table, and the first choice of each unit that moved."""
        changed = [n for n, c in second.choice.items() if c != self.alloc.choice[n]]
        first = float(sum(u.delta[self.alloc.choice[u.name]] for u in refined))
        return {"run": True, "changed_units": len(changed), "solves": self.solves,
                "probe_seconds": self.probe_seconds, "requantize_seconds": requantize_seconds,
                "predicted_delta_first": first, "predicted_delta_refined": second.total_delta,
                "first_choice": {n: candidate_label(self.alloc.choice[n]) for n in changed}}

    def round(self, result: QuantizeResult, avg_bits: float, quantize: Callable[[dict], QuantizeResult],
              restore: Callable[[], None], max_cells: int = 100_000,
              ) -> tuple[Allocation, QuantizeResult, list[Unit], dict]:
        """Solve again on the refined table of ``result`` (the probed pass); when the allocation
        moved, ``restore()`` the float weights and ``quantize(choice)`` the new one. Returns
        (allocation, kept result, refined table, :meth:`summary`)."""
        refined = self.refined(result)
        second = allocate_bits(refined, avg_bits, candidates=self.cands, max_cells=max_cells)
        t0 = time.perf_counter()
        if second.choice != self.alloc.choice:
            restore()
            result = quantize(second.choice)
        return second, result, refined, self.summary(refined, second, time.perf_counter() - t0)
