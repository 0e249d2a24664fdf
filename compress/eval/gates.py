"""Quality gates for CI: fail (exit code 3) when a compressed model drifts too far.

Usage::

    layercut eval OUT --reference bundled:smollm2-135m --max-ppl-increase 5% --max-kl 0.1 --json

    from layercut.compress.eval.gates import check_gates, enforce_gates
    gates = check_gates(result.to_dict(), max_ppl_increase=0.05, max_kl=0.1)
    payload = enforce_gates(result.to_dict(), gates)   # raises GateFailed naming the failed gates

Gate values: ``ppl_increase = ppl / reference_ppl − 1`` (relative, 0.05 = 5%) and
``kl`` = mean KL(p_reference ‖ p_model) per scored token (see :mod:`layercut.compress.eval.evaluate`).
A NaN or missing value fails its gate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from layercut.compress.core.errors import GateFailed, LayercutError
from layercut.compress.options import parse_fraction


@dataclass
class Gate:
    name: str  # "max_ppl_increase" | "max_kl"
    limit: float
    value: float | None
    passed: bool

    def describe(self) -> str:
        if self.name == "max_ppl_increase":
            value = "n/a" if self.value is None else f"{self.value:+.2%}"
            return f"perplexity increase {value} > limit {self.limit:.2%}"
        value = "n/a" if self.value is None else f"{self.value:.4g}"
        return f"KL {value} > limit {self.limit:.4g}"


def parse_limit(value: str | float | None, what: str) -> float | None:
    """A CLI/recipe limit as a float (``"5%"`` -> 0.05); ``None`` passes through."""
    if value is None:
        return None
    try:
        return parse_fraction(value, what)
    except ValueError as exc:
        raise LayercutError(str(exc)) from None


def check_gates(result: dict, max_ppl_increase: float | None = None, max_kl: float | None = None) -> list[Gate]:
    """Evaluate the requested gates on an eval result dict (needs ``reference_ppl`` and ``kl``)."""
    gates: list[Gate] = []
    if max_ppl_increase is not None:
        ppl, ref = result.get("ppl"), result.get("reference_ppl")
        value = ppl / ref - 1.0 if ppl is not None and ref else None
        gates.append(Gate("max_ppl_increase", max_ppl_increase, value, _ok(value, max_ppl_increase)))
    if max_kl is not None:
        value = result.get("kl")
        gates.append(Gate("max_kl", max_kl, value, _ok(value, max_kl)))
    return gates


def _ok(value: float | None, limit: float) -> bool:
    # 1e-12: 21/20 − 1 is 0.05000000000000004 in floating point, and should pass a 5% gate
    return value is not None and not math.isnan(value) and value <= limit + 1e-12


def enforce_gates(result: dict, gates: list[Gate]) -> dict:
    """``result`` plus ``gates``/``gates_passed``/``failed_gates``; raise :class:`GateFailed` if any failed.

    The exception carries the same dict as ``payload`` so ``--json`` still prints it.
    """
    failed = [g for g in gates if not g.passed]
    payload = {
        **result,
        "gates": [asdict(g) for g in gates],
        "gates_passed": not failed,
        "failed_gates": [g.name for g in failed],
    }
    if failed:
        exc = GateFailed("quality gate failed: " + "; ".join(g.describe() for g in failed))
        exc.payload = payload
        raise exc
    return payload
