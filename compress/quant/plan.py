"""The quantize plan: what a quantize run does to each linear, as data, before any tensor changes.

Usage::

    from layercut.compress.quant.plan import build_plan
    plan = build_plan(QuantizeConfig(bits=4), model)   # an in-memory model, or a LazyModel's skeleton
    plan.group_size, plan.pairs(), plan.head, plan.solver
    plan.rows()                                        # the table `--dry-run` prints

    layercut quantize MODEL --bits 4 --dry-run         # prints it, writes nothing

Built once per run from the :class:`~layercut.compress.quant.config.QuantizeConfig` and the model's
facts (:func:`model_facts`: each target linear's name, block, fused group and shape, and the output
head): the group size is resolved here and only here (the config's, else
:func:`~layercut.compress.quant.solve.settings.pick_group_size` of the input sizes), bare candidate
and head widths are read at it, and :func:`solver_settings` builds the solver's
:class:`~layercut.compress.quant.solve.settings.SolverConfig`. :func:`build_plan` then checks the
model against it before any work (:func:`layercut.compress.quant.solve.driver.check_model`,
:func:`layercut.compress.quant.solve.head.check_head`).

Uniform ``bits``: every linear's (bits, group size) is known at once. With ``avg_bits`` the plan is
built in two steps: :func:`build_plan` leaves each linear's pair open (None) and carries the budget,
the listed candidates and the unit; once the allocation (and the fallback check) has run, the stage
calls ``plan.with_pairs(result.configs())``, so the plan then holds the pairs that were written (the
mixed allocation, or the uniform baseline where it won the fallback check).

The stage (``compress/workflow/stages/quantize.py``) executes the plan with one executor and two
sinks (in memory, or streamed into a checkpoint), stores ``plan.to_dict()`` as ``quantize.json``'s
``plan``, and a resumed run (``layercut run ... --resume``) rebuilds the plan of its options on the
stored model facts (:meth:`QuantPlan.from_dict`, :func:`plan_from_facts`) and stops at the first
difference (:meth:`QuantPlan.difference`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from layercut.compress.core.arch import arch_for, target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.search.candidates import Candidate, candidate_label, parse_candidate
from layercut.compress.quant.solve.driver import GROUP_LABELS, check_model, linear_weight
from layercut.compress.quant.solve.head import check_head, head_is_tied, output_head
from layercut.compress.quant.solve.settings import GPTQ_BLOCK_SIZE, BlockTune, SolverConfig, pick_group_size

PLAN_VERSION = 1
# The solver's width for linears that no per-linear map names. Under avg_bits every linear is
# mapped (each unit's allocated pair), so it is never read there; it is the solver's usual 4.
UNMAPPED_BITS = 4


def solver_settings(config: QuantizeConfig, group_size: int | None = None) -> SolverConfig:
    """The solver's settings of ``config`` at ``group_size`` (the resolved one; default: the config's
    own, which must then be given). The one place a :class:`SolverConfig` is built from options:
    RTN gets no scale search and no refit, ``block_tune`` becomes a :class:`BlockTune`."""
    gs = config.group_size if group_size is None else group_size
    if gs is None:
        raise LayercutError("quantize: the group size is not resolved yet (build_plan resolves it per model)")
    gptq = config.method == "gptq"
    tune = BlockTune(steps=config.block_tune_steps, batch=config.block_tune_batch, lr=config.block_tune_lr,
                     scale_lr=config.block_tune_scale_lr, norm_lr=config.block_tune_norm_lr,
                     target=config.block_tune_target,
                     loss=config.block_tune_loss, seed=config.seed) if config.block_tune else None
    return SolverConfig(bits=config.bits if config.bits is not None else UNMAPPED_BITS, group_size=gs,
                        sym=config.sym, act_order=config.act_order, static_groups=config.static_groups,
                        group_aware=config.group_aware, damp=config.damp, method=config.method,
                        sequential=config.sequential, block_size=GPTQ_BLOCK_SIZE, solve_dtype=config.solve_dtype,
                        scale_search=config.scale_search if gptq else "none", scale_min=config.scale_min,
                        scale_steps=config.scale_steps, scale_bounds=config.scale_bounds,
                        refit_scales=config.refit_scales and gptq, tune=tune)


@dataclass(frozen=True)
class LinearPlan:
    """One target linear: where it sits, its shape, and its (bits, group size); None = left to the
    allocation (``avg_bits``, before :meth:`QuantPlan.with_pairs`)."""

    name: str
    block: int
    group: int  # the fused group's index in the architecture: GROUP_LABELS (qkv, o, gate_up, down)
    in_features: int
    out_features: int
    pair: Candidate | None = None


@dataclass(frozen=True)
class OutputHead:
    """The model's output head (whether or not it is quantized)."""

    name: str
    in_features: int
    out_features: int
    tied: bool  # shares its weight with the input embedding: cannot be quantized


@dataclass(frozen=True)
class ModelFacts:
    """What a plan needs of a model: its target linears (no pairs) and its output head."""

    linears: tuple[LinearPlan, ...]
    head: OutputHead | None


def model_facts(model: nn.Module) -> ModelFacts:
    """The target linears (forward order) and the output head of ``model`` (in memory or a lazily
    loaded skeleton: only names and shapes are read)."""
    spec = arch_for(model)
    linears = tuple(LinearPlan(name, i, g, *_shape(module, spec.conv1d)) for i, g, name, module in target_linears(model, spec))
    found = output_head(model)
    head = None
    if found is not None:
        head = OutputHead(found[0], *_shape(found[1], False), head_is_tied(model))
    return ModelFacts(linears, head)


def _shape(module: nn.Module, conv1d: bool) -> tuple[int, int]:
    """(in_features, out_features) of a dense linear; (0, 0) for anything else (check_model and
    check_head refuse those with their own message)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return 0, 0
    out_f, in_f = linear_weight(module, conv1d).shape
    return int(in_f), int(out_f)


@dataclass(frozen=True)
class QuantPlan:
    """Bits and group size per target linear, the head, the method and the solver's settings of
    one quantize run (see the module doc)."""

    method: str  # gptq | rtn
    bits: int | None  # uniform bits; None with avg_bits
    avg_bits: float | None  # the budget; None with uniform bits
    candidates: tuple[Candidate, ...] | None  # avg_bits: the listed pairs (None: the default set)
    unit: str | None  # avg_bits: what gets one pair (group | layer)
    group_size: int  # resolved: the config's, else the model's default
    group_size_from: str  # given | default
    solver: SolverConfig
    linears: tuple[LinearPlan, ...]
    output_head: OutputHead | None  # the model's head
    head: Candidate | None = None  # the head's (bits, group size) when it is quantized

    @property
    def allocated(self) -> bool:
        """True when every linear's pair is known (uniform bits, or after :meth:`with_pairs`)."""
        return all(lin.pair is not None for lin in self.linears)

    def pairs(self) -> dict[str, Candidate]:
        """(bits, group size) per target linear (the driver's per-linear map)."""
        if not self.allocated:
            raise LayercutError("internal: the plan's pairs are chosen by the allocation (avg_bits); not yet known")
        return {lin.name: lin.pair for lin in self.linears}

    def with_pairs(self, pairs: Mapping[str, Candidate]) -> QuantPlan:
        """The plan with each linear's pair taken from ``pairs`` (e.g. ``result.configs()`` of the
        written result, after the allocation): the second step of an ``avg_bits`` plan."""
        missing = [lin.name for lin in self.linears if lin.name not in pairs]
        if missing:
            raise LayercutError(f"internal: no (bits, group size) for {missing[0]} (and {len(missing) - 1} more)")
        return replace(self, linears=tuple(replace(lin, pair=(int(pairs[lin.name][0]), int(pairs[lin.name][1])))
                                           for lin in self.linears))

    def facts(self) -> ModelFacts:
        """The model facts this plan was built on (to build another config's plan without the model)."""
        return ModelFacts(tuple(replace(lin, pair=None) for lin in self.linears), self.output_head)

    # ------------------------------------------------------------------ stored form

    def to_dict(self) -> dict:
        """The plan as ``quantize.json`` stores it (JSON types; :meth:`from_dict` reads it back)."""
        head = self.output_head
        return {
            "version": PLAN_VERSION, "method": self.method, "bits": self.bits, "avg_bits": self.avg_bits,
            "candidates": None if self.candidates is None else [candidate_label(c) for c in self.candidates],
            "unit": self.unit, "group_size": self.group_size, "group_size_from": self.group_size_from,
            "head": None if self.head is None else {"module": head.name, "config": candidate_label(self.head)},
            "solver": self.solver.to_dict(),
            "linears": {lin.name: {"block": lin.block, "group": lin.group, "in_features": lin.in_features,
                                   "out_features": lin.out_features,
                                   "config": None if lin.pair is None else candidate_label(lin.pair)}
                        for lin in self.linears},
            "output_head": None if head is None else {"module": head.name, "in_features": head.in_features,
                                                      "out_features": head.out_features, "tied": head.tied},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantPlan:
        if data.get("version") != PLAN_VERSION:
            raise LayercutError(f"quantize plan version {data.get('version')!r} is not {PLAN_VERSION}")
        solver = dict(data["solver"])
        tune = solver.pop("tune")
        oh = data["output_head"]
        return cls(
            method=data["method"], bits=data["bits"], avg_bits=data["avg_bits"],
            candidates=None if data["candidates"] is None else tuple(parse_candidate(c, 0) for c in data["candidates"]),
            unit=data["unit"], group_size=data["group_size"], group_size_from=data["group_size_from"],
            solver=SolverConfig(**solver, tune=None if tune is None else BlockTune(**tune)),
            linears=tuple(LinearPlan(name, v["block"], v["group"], v["in_features"], v["out_features"],
                                     None if v["config"] is None else parse_candidate(v["config"], 0))
                          for name, v in data["linears"].items()),
            output_head=None if oh is None else OutputHead(oh["module"], oh["in_features"], oh["out_features"],
                                                           oh["tied"]),
            head=None if data["head"] is None else parse_candidate(data["head"]["config"], 0),
        )

    def difference(self, other: QuantPlan) -> str | None:
        """The first difference from ``other`` (``key: old -> new``), or None when they plan the same
        run. The linears' pairs of an ``avg_bits`` plan are the allocation's, chosen on data: they
        are not compared (the budget, candidates, unit and solver are)."""
        a, b = self.to_dict(), other.to_dict()
        if self.avg_bits is not None or other.avg_bits is not None:
            for d in (a, b):
                for v in d["linears"].values():
                    v["config"] = None
        return _first_difference(a, b)

    # ------------------------------------------------------------------ the printed table

    def rows(self) -> dict[str, str]:
        """The plan as one two-column table (what ``layercut quantize --dry-run`` prints): the
        method and solver, the group size, the bits, then one row per run of decoder blocks whose
        fused groups share their pairs, and the head."""
        s = self.solver
        how = [("symmetric" if s.sym else "asymmetric")]
        if s.method == "gptq":
            how += (["act order"] if s.act_order else []) + (["static groups"] if s.static_groups else []) + \
                (["group-aware order"] if s.group_aware else []) + \
                [f"damp {s.damp:g}", f"solve {s.solve_dtype}", f"sequential {s.sequential}"]
        out = {"method": f"{s.method.upper()} ({', '.join(how)})"}
        if s.method == "gptq":
            out["scale search"] = "none" if s.scale_search == "none" else \
                f"{s.scale_search}, factors 1 to {s.scale_min:g} in {s.scale_steps} steps, {s.scale_bounds} bounds"
            out["refit scales"] = "on" if s.refit_scales else "off"
            t = s.tune
            out["block tuning"] = "off" if t is None else \
                f"{t.steps} steps of {t.batch} sequences, lr {t.lr:g}, scale lr {t.scale_lr:g}, target {t.target}, " \
                f"loss {t.loss}"
        out["group size"] = f"{self.group_size} ({'given' if self.group_size_from == 'given' else 'default: the first of 128, 64, 32 that divides every input size, else -1'})"
        if self.avg_bits is not None:
            cands = "the default set" if self.candidates is None else ",".join(map(candidate_label, self.candidates))
            out["bits"] = f"{self.avg_bits:g} per weight on average, one pair per {self.unit} from {cands}" + \
                ("" if not self.allocated else " (allocated)")
        else:
            out["bits"] = f"{self.bits} (uniform)"
        blocks = sorted({lin.block for lin in self.linears})
        out["linears"] = f"{len(self.linears)} in {len(blocks)} blocks"
        per_block: dict[int, tuple[str, ...]] = {}
        for i in blocks:
            cells: dict[int, set[str]] = {}
            for lin in self.linears:
                if lin.block == i:
                    cells.setdefault(lin.group, set()).add("chosen" if lin.pair is None else candidate_label(lin.pair))
            per_block[i] = tuple(f"{GROUP_LABELS[g] if g < len(GROUP_LABELS) else g} {'/'.join(sorted(c))}"
                                 for g, c in sorted(cells.items()))
        start = 0
        for k, i in enumerate(blocks):
            last = k + 1 == len(blocks) or per_block[blocks[k + 1]] != per_block[i]
            if last:
                first = blocks[start]
                out[f"block {first}" if first == i else f"blocks {first}-{i}"] = "  ".join(per_block[i])
                start = k + 1
        oh = self.output_head
        if oh is None:
            out["head"] = "none"
        elif self.head is not None:
            out[f"head {oh.name}"] = f"{candidate_label(self.head)} ({oh.out_features} x {oh.in_features})"
        else:
            out[f"head {oh.name}"] = "not quantized" + (" (tied to the input embedding)" if oh.tied else "")
        return out


def plan_from_facts(config: QuantizeConfig, facts: ModelFacts) -> QuantPlan:
    """The plan of ``config`` for a model with these facts (nothing is checked against a model:
    :func:`build_plan` does that)."""
    given = config.group_size is not None
    gs = config.group_size if given else pick_group_size(lin.in_features for lin in facts.linears)
    mixed = config.avg_bits is not None
    pairs = config.candidate_pairs(gs) if mixed else None
    return QuantPlan(
        method=config.method, bits=config.bits, avg_bits=config.avg_bits,
        candidates=None if pairs is None else tuple(pairs), unit=config.unit if mixed else None,
        group_size=gs, group_size_from="given" if given else "default", solver=solver_settings(config, gs),
        linears=tuple(replace(lin, pair=None if mixed else (config.bits, gs)) for lin in facts.linears),
        output_head=facts.head, head=config.head_pair(gs),
    )


def build_plan(config: QuantizeConfig, model: nn.Module) -> QuantPlan:
    """The plan of ``config`` for ``model``, checked against the model before any work: an
    already-quantized model, group sizes that do not divide an input size (uniform bits; with
    ``avg_bits`` each unit's candidates are checked by the allocation), fused projections, non-finite
    weights (resident ones), and the head (:func:`~layercut.compress.quant.solve.head.check_head`)."""
    plan = plan_from_facts(config, model_facts(model))
    check_model(model, plan.solver if plan.avg_bits is None else replace(plan.solver, group_size=-1))
    if plan.head is not None:
        check_head(model, *plan.head)
    return plan


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            found = _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if found is not None:
                return found
        return None
    if a != b:
        return f"{prefix.rstrip('.')}: {a!r} -> {b!r}"
    return None

