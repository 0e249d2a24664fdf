"""Healing settings and the result record.

Usage::

    from layercut.heal.config import HealConfig
    cfg = HealConfig(steps=300, rank=16, loss="kd", lr=5e-4)    # typo'd keys are errors
    cfg = HealConfig.parse({"steps": 300})                      # LayercutError on bad input

``HealConfig`` is the heal stage's one config (:mod:`layercut.compress.stages.heal`), shared by
the CLI, recipes and :func:`layercut.heal.train.heal_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layercut.compress.stages.heal import BUNDLED_HEAL_OFFSET, DEFAULT_DATA, HealConfig

__all__ = ["HealConfig", "HealResult", "BUNDLED_HEAL_OFFSET", "DEFAULT_DATA"]


@dataclass
class HealResult:
    """What :func:`layercut.heal.train.heal_model` did. ``model`` is the merged (dense) student."""

    steps: int
    tokens: int  # real (non-pad) tokens trained on, this process
    seconds: float
    tokens_per_s: float
    loss_first: float  # mean loss of the first min(10, steps) steps
    loss_last: float  # mean loss of the last min(10, steps) steps
    trainable_params: int
    targets: list[str]
    lora_modules: int
    quantized_input: bool
    merged: bool
    resumed_from: int = 0
    output: str | None = None
    adapter: str | None = None
    notes: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    model: Any = None

    def to_dict(self, with_losses: bool = False) -> dict[str, Any]:
        # shallow on purpose: dataclasses.asdict would deep-copy the model
        d = {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items() if k != "model"}
        if not with_losses:
            d.pop("losses", None)
        return d
