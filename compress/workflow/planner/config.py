"""Options of ``layercut plan`` and of a recipe's ``target:`` (one strict config for both).

>>> PlanConfig(size="40%").size
'40%'
>>> PlanConfig(size="1.2GB", min_speedup=1.25).target_bytes(10**10)
1200000000
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.compress.core.units import check_size, parse_size
from layercut.compress.options import StageConfig, parse_fraction
from layercut.compress.quant.format.result import SUPPORTED_BITS

SIZE_HELP = "a percentage of the source's bf16 bytes (40%) or a size with a unit (1.2GB, 800MiB)"


class PlanConfig(StageConfig):
    """What the planner aims for and how hard it searches."""

    size: str = Field(description="target size of the weight files: " + SIZE_HELP)
    min_speedup: float | None = Field(None, description="keep at most depth / X blocks (a decode-speed proxy)")
    budget_minutes: float | None = Field(None, gt=0, description="stop searching after this many minutes "
                                                                  "(at least one candidate is verified)")
    top_k: int = Field(2, ge=1, description="candidates run for real and measured, best predicted first")
    bits: list[int] = Field([2, 3, 4, 8], description="uniform bit widths searched")
    group_sizes: list[int] = Field([128, 64, -1], description="group sizes searched (-1: one per row); those "
                                                              "that do not divide every quantized layer's "
                                                              "inputs are skipped")
    mixed: bool = Field(True, description="also search --avg-bits allocations filling the bytes left")
    dense: bool = Field(True, description="also search depth-only cuts written in bf16")
    max_drop: int | str = Field("50%", description="most blocks a cut may remove (a count or a percentage)")
    calib: str = Field(DEFAULT_CALIB_TEXT, description="calibration text of every stage and of the KL judge")
    samples: int = Field(64, ge=1, description="quantize calibration sequences")
    prune_samples: int = Field(32, ge=1, description="prune calibration sequences (selection and lstsq fit)")
    seq_len: int = Field(128, ge=2, description="tokens per calibration sequence")
    kl_samples: int = Field(16, ge=1, description="held-apart calibration sequences the KL is measured on")
    seed: int = Field(0, description="calibration sampling seed")

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        text = str(v).strip()
        if text.endswith("%"):
            frac = parse_fraction(text, "target size")
            if not 0 < frac:
                raise ValueError(f"target size must be above 0%, got '{v}'")
            return text
        if text.lstrip("-").replace(".", "", 1).isdigit():
            raise ValueError(f"target size '{v}' has no unit: give {SIZE_HELP}")
        try:
            return check_size(text)
        except ValueError:
            raise ValueError(f"target size '{v}' is not {SIZE_HELP}") from None

    @field_validator("min_speedup")
    @classmethod
    def _speedup(cls, v: float | None) -> float | None:
        if v is not None and (not math.isfinite(v) or v < 1):
            raise ValueError(f"min_speedup must be a number >= 1 (kept blocks <= depth / X), got {v}")
        return v

    @field_validator("max_drop")
    @classmethod
    def _max_drop(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"max_drop must be >= 0, got {v}")
        if isinstance(v, str) and not (v.strip().endswith("%") and 0 <= parse_fraction(v) < 1):
            raise ValueError(f"max_drop must be a count or a percentage below 100%, got '{v}'")
        return v

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: list[int]) -> list[int]:
        if not v or any(b not in SUPPORTED_BITS for b in v):
            raise ValueError(f"bits must be among {', '.join(map(str, SUPPORTED_BITS))}, got {v}")
        return v

    def target_bytes(self, bf16_bytes: int) -> int:
        """The target in bytes: a percentage of ``bf16_bytes``, or the absolute size."""
        if self.size.endswith("%"):
            return int(parse_fraction(self.size) * bf16_bytes)
        return parse_size(self.size)

    def max_drop_count(self, num_blocks: int) -> int:
        if isinstance(self.max_drop, int):
            return min(self.max_drop, num_blocks - 1)
        return min(int(parse_fraction(self.max_drop) * num_blocks), num_blocks - 1)

    def min_drop(self, num_blocks: int) -> int:
        """Blocks a cut must remove for ``min_speedup``: kept <= floor(depth / X)."""
        if self.min_speedup is None:
            return 0
        return num_blocks - math.floor(num_blocks / self.min_speedup + 1e-9)
