"""The solver settings the solver-level tests pin: plain GPTQ (no act order, no static groups, no
scale search), built the one way settings are built, from a QuantizeConfig
(:func:`layercut.compress.quant.plan.solver_settings`); ``tune``: a BlockTune to add (its
``optimizer`` and ``init`` knobs are not options of the stage).

    cfg = plain_solver(bits=4, group_size=32)                    # GPTQ, asymmetric, damp 0.01
    cfg = plain_solver(bits=3, group_size=32, method="rtn")
"""

from __future__ import annotations

from dataclasses import replace

from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.plan import solver_settings
from layercut.compress.quant.solve.settings import BlockTune, SolverConfig

PLAIN = dict(act_order=False, static_groups=False, scale_search="none", scale_bounds="joint")


def plain_solver(bits: int = 4, group_size: int = 128, tune: BlockTune | None = None, **options) -> SolverConfig:
    cfg = solver_settings(QuantizeConfig(bits=bits, group_size=group_size, **{**PLAIN, **options}))
    return cfg if tune is None else replace(cfg, tune=tune)
