"""The solver's own argument set, torch-free at import: :class:`SolverConfig` (how every linear is
solved) and :class:`BlockTune` (block-wise reconstruction after the solves).

``SolverConfig`` has no defaults and checks nothing: the options and their defaults are
:class:`layercut.compress.quant.config.QuantizeConfig`'s, validated there once, and the plan
(:func:`layercut.compress.quant.plan.solver_settings`, ``QuantPlan.solver``) is the one place that
builds it from them::

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.plan import solver_settings
    cfg = solver_settings(QuantizeConfig(bits=4, group_size=64))      # SolverConfig(bits=4, group_size=64, ...)
    quantize_model(model, calib, cfg)                                  # compress/quant/solve/driver.py

A Python caller that wants other values replaces fields of a built one
(``dataclasses.replace(cfg, act_order=False)``); the solver trusts them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from layercut.compress.core.errors import LayercutError

GPTQ_BLOCK_SIZE = 128  # columns GPTQ updates lazily at once (Frantar et al. 2022, §3 "lazy batch updates")
AUTO_GROUP_SIZES = (128, 64, 32)  # the group-size default: the first that divides every input size


def pick_group_size(in_features: Iterable[int]) -> int:
    """The default group size for linears of these input sizes: 128 (the GPTQ convention) where it
    divides every one, else the largest of 64, 32 that does, else -1 (one group per row).

    >>> pick_group_size([576, 1536]), pick_group_size([64, 96]), pick_group_size([72])
    (64, 32, -1)
    """
    sizes = set(in_features)
    return next((g for g in AUTO_GROUP_SIZES if all(n % g == 0 for n in sizes)), -1)


@dataclass(frozen=True)
class SolverConfig:
    """How to solve each linear (every field given; see the module doc for where it is built).

    ``bits`` and ``group_size`` are the pair of every linear a per-linear map does not name;
    ``method`` "gptq" | "rtn"; ``sequential`` "block" | "sublayer" | "linear" (driver's module
    doc); ``block_size``: GPTQ's lazy-batch width; ``solve_dtype`` "float32" | "float64": the
    damped Hessian's factorization and inverse (H is summed in float64 either way); the scale
    search ("none" | "mse" | "hessian" | "obs") shrinks each group's min/max range by the factors
    1 .. ``scale_min`` in ``scale_steps`` steps, both ends by one factor (``scale_bounds`` "joint")
    or each by its own ("separate"); ``refit_scales`` re-solves the group scales by least squares
    once the codes are chosen (scale_fit.py); ``tune``: block-wise reconstruction, None = off.
    """

    bits: int
    group_size: int
    sym: bool
    act_order: bool
    static_groups: bool
    group_aware: bool  # GAR column order (see gptq_quantize); act_order wins if both
    damp: float
    method: str
    sequential: str
    block_size: int
    solve_dtype: str
    scale_search: str
    scale_min: float
    scale_steps: int
    scale_bounds: str
    refit_scales: bool
    tune: BlockTune | None

    def to_dict(self) -> dict:
        """The settings as JSON (the plan stores and compares them)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tune"}
        out["tune"] = None if self.tune is None else {k: getattr(self.tune, k) for k in self.tune.__dataclass_fields__}
        return out


TARGETS = ("quantized", "float")
LOSSES = ("mse", "channel")
OPTIMIZERS = ("adam", "sign")
INITS = ("residual", "zero")


@dataclass(frozen=True)
class BlockTune:
    """Settings of block-wise reconstruction (compress/quant/solve/block_tune.py's module doc).
    The stage builds it from ``QuantizeConfig.block_tune_*``; ``optimizer`` and ``init`` are
    research knobs of the Python API only."""

    steps: int = 100
    batch: int = 4  # calibration sequences per step, drawn from one micro-batch
    lr: float = 0.003  # step of the rounding offsets, in code units (decays linearly to 0)
    scale_lr: float = 0.002  # Adam's step for the relative scale change
    norm_lr: float = 0.0  # Adam's step for the block's norm weights (0: they stay the model's)
    target: str = "float"  # "quantized" | "float": whose inputs the float block's target output is computed on
    optimizer: str = "adam"  # "adam" | "sign" (AutoRound's signed steps): the offsets' optimiser
    init: str = "residual"  # "residual" | "zero": where the offsets start
    loss: str = "channel"  # "channel": each hidden channel's error over its mean square in the target | "mse"
    seed: int = 0

    def check(self) -> None:
        if self.steps <= 0 or self.batch <= 0:
            raise LayercutError(f"quantize: block tuning steps and batch must be positive, got {self.steps}, "
                                f"{self.batch}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not all(
                x >= 0 and math.isfinite(x) for x in (self.scale_lr, self.norm_lr)):
            raise LayercutError(f"quantize: block tuning learning rates must be positive, got lr {self.lr}, "
                                f"scale lr {self.scale_lr}, norm lr {self.norm_lr}")
        if self.optimizer not in OPTIMIZERS or self.init not in INITS:
            raise LayercutError(f"quantize: block tuning optimizer must be one of {OPTIMIZERS} and init one of "
                                f"{INITS}, got {self.optimizer!r}, {self.init!r}")
        if self.loss not in LOSSES:
            raise LayercutError(f"quantize: block tuning loss must be one of {LOSSES}, got {self.loss!r}")
        if self.target not in TARGETS:
            raise LayercutError(f"quantize: block tuning target must be one of {TARGETS}, got {self.target!r}")
