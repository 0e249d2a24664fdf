"""The quantize stage's options, beside the solver: :class:`QuantizeConfig` (the CLI flags of
``layercut quantize``, a recipe's ``quantize`` keys and the Python options) and
:func:`parse_candidates`.

Usage::

    from layercut.compress.quant.config import QuantizeConfig
    config = QuantizeConfig(avg_bits=3.5, candidates="3g64,4ch,8")
    plan = build_plan(config, model)    # compress/quant/plan.py: group size resolved, per-linear pairs, solver

The options, their defaults and their rules live here only: the solver's
:class:`~layercut.compress.quant.solve.settings.SolverConfig` has no defaults and checks nothing, and
the plan (:func:`layercut.compress.quant.plan.solver_settings`) is the one place that builds it
from a config. Importing it does not import torch (``layercut --help`` and reading a recipe stay fast).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.compress.options import (
    STREAM_DTYPE_HELP,
    TEXT_SPEC_HELP,
    WHOLE_MODEL_HELP,
    Dtype,
    SaveDtype,
    StageConfig,
    TextOptions,
    TextSpec,
    chat_template_option,
    device_option,
    messages_field_option,
    text_field_option,
)
from layercut.compress.quant.format.result import SUPPORTED_BITS
from layercut.compress.quant.search.candidates import DEFAULT_CANDIDATES, parse_candidate

# Where the group size is still unresolved (None: chosen per model by the plan), bare candidate
# bits and a bare head width are read at this size; only the checks here see it, the plan passes
# the resolved size.
UNRESOLVED_GROUP_SIZE = 128


# --preset: what each one sets, unless the option is given explicitly (cost and quality measured in
# docs/quantize.md, "Presets").
PRESETS: dict[str, dict[str, object]] = {
    "fast": {"method": "rtn"},
    "default": {},
    "best": {"block_tune": True},
}


def parse_candidates(value: str | list, group_size: int) -> list[tuple[int, int]]:
    """``"3g64,4ch,8"`` or ``[4, "3g64"]`` -> (bits, group size) pairs; bare bits take ``group_size``.

    >>> parse_candidates("3g64, 4ch,8", 64)
    [(3, 64), (4, -1), (8, 64)]
    """
    items = value if isinstance(value, list) else [x for x in str(value).split(",") if x.strip()]
    return list(dict.fromkeys(parse_candidate(x, group_size) for x in items))


class QuantizeConfig(StageConfig, TextOptions):
    """Options of ``layercut quantize`` and of a recipe's ``quantize`` stage.

    >>> QuantizeConfig(avg_bits=3.5, candidates="3g64,4ch,8", group_size=64).candidate_pairs()
    [(3, 64), (4, -1), (8, 64)]
    """

    help: ClassVar[str] = ("GPTQ (or round-to-nearest) with uniform bits, or bits and group size chosen per unit "
                           "under a budget")
    examples: ClassVar[tuple[str, ...]] = (
        "layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64",
        "layercut quantize ./pruned -o mixed --avg-bits 3.5 --candidates 3g64,3g128,4g64,4ch,8ch",
    )
    everyday: ClassVar[tuple[str, ...]] = ("preset", "bits", "avg_bits", "group_size", "method", "block_tune", "calib",
                                           "samples", "device")

    stage: Literal["quantize"] = "quantize"
    preset: Literal["fast", "default", "best"] = Field(
        "default", description="fast: round-to-nearest (seconds; far worse than GPTQ below 8 bits); default: GPTQ; "
                               "best: GPTQ + --block-tune (about 5-8x GPTQ's time, 4-bit KL 13-23% lower). "
                               "Options given explicitly override what the preset sets")
    bits: int | None = Field(None, description="uniform bits per weight: 2, 3, 4 or 8 (give this or --avg-bits)",
                             json_schema_extra={"metavar": "B"})
    avg_bits: float | None = Field(None, gt=0, description="average bits per weight to spend, scales and zeros "
                                                           "included; bits and group size are then chosen per unit",
                                   json_schema_extra={"metavar": "X"})
    candidates: str | list[int | str] | None = Field(
        None, description="(bits, group size) pairs the per-unit choice picks from: 3g64 = 3 bits in groups of 64 "
                          "columns, 4ch = 4 bits with one group per row, a bare 4 = 4 bits at --group-size; "
                          "none = 3g128,3g64,3g32,4ch,4g128,4g64,8ch, plus 3ch when no other pair fits the "
                          "budget uniformly, and 2g64,2g32 when it is below uniform 3ch", json_schema_extra={"metavar": "LIST"})
    unit: Literal["layer", "group"] = Field("group", description="what gets one configuration: each group of "
                                                                 "linears sharing an input (fused by servers), or "
                                                                 "a whole decoder layer")
    sensitivity: Literal["loss", "output", "output_rel", "kl", "kl-swap"] = Field(
        "loss", description="how much each unit suffers at each candidate: GPTQ's own layer loss (no extra "
                            "forwards; the default: it scored best of the cheap measures against the exact "
                            "table and costs least), the block output error (absolute or relative; one block "
                            "forward per unit and candidate), the model's KL (exact, slow), or kl-swap: full "
                            "quantizations at the uniform baseline and at each candidate (default: the "
                            "baseline's bits per channel and the next width up), then the true KL change of "
                            "swapping each unit alone on --sensitivity-samples held-apart sequences (a forward "
                            "from the unit's block onward per swap; streams)")
    sensitivity_samples: int = Field(16, ge=1, description="calibration sequences used to measure sensitivity "
                                                           "(kl-swap: as many held apart); as many more, held "
                                                           "apart, judge the fallback check")
    refine: bool = Field(False, description="one refinement round (GPTQ with --sensitivity loss): while the "
                                            "chosen allocation is quantized, re-solve each unit's neighbouring "
                                            "candidates on the Hessian of the quantized prefix, solve the "
                                            "allocation again, and quantize again if it moved (off: on the "
                                            "validation text it moved 4-10 units and did not lower the KL)")
    fallback_check: bool = Field(True, description="also quantize the uniform baseline (the costliest candidate "
                                                   "that fits the budget uniformly) and write it instead when the "
                                                   "mixed result's KL to the float model is not lower on held-apart "
                                                   "calibration sequences (about doubles the run time)")
    group_size: int | None = Field(None, description="columns sharing one scale and zero point, -1 for one per "
                                                     "row; must divide every layer's input size (with "
                                                     "--avg-bits: the group size of bare candidate bits); none "
                                                     "= 128 where it divides every quantized layer's input "
                                                     "size, else 64, else 32, else -1 (the report says which)")
    sym: bool = Field(False, description="symmetric quantization (no zero point)")
    act_order: bool = Field(True, description="quantize columns in order of decreasing input energy")
    static_groups: bool = Field(True, description="fix each group's scale and zero from the original weight "
                                                  "first (then loaders need no column reordering)")
    group_aware: bool = Field(False, description="order whole groups by their largest input energy, then "
                                                 "columns within each group (GPTQModel's default)")
    method: Literal["gptq", "rtn"] = Field("gptq", description="GPTQ, or plain round-to-nearest")
    damp: float = Field(0.01, gt=0, lt=1, description="GPTQ damping, which keeps the solve stable: a fraction "
                                                         "of the layer's mean input energy")
    solve_dtype: Literal["float32", "float64"] = Field(
        "float32", description="precision of the damped Hessian's factorization and inverse (the Hessian is "
                               "summed in float64 either way); float32 halves the solve's largest buffers")
    sequential: Literal["block", "sublayer", "linear"] = Field(
        "block", description="how often each block's inputs are re-collected: once, per sublayer (2), per "
                             "linear group (4)")
    # --- scale search (compress/quant/solve/gptq.py) ---
    scale_search: Literal["none", "mse", "hessian", "obs"] = Field(
        "hessian", description="GPTQ only: per group and row, shrink the min/max range by the factor (1 down to "
                               "--scale-min) whose rounding error is least when the group's scale is fixed, the "
                               "error weighted by each input's energy, the Hessian diagonal (hessian; the default, "
                               "chosen on brown-val), unweighted (mse, as GPTQModel's mse option) or by what GPTQ's "
                               "own loss charges a column, 1/[chol(H^-1)]_jj^2 (obs); none = plain min/max")
    scale_min: float = Field(0.75, gt=0, le=1, description="smallest shrink factor the scale search tries")
    scale_steps: int = Field(5, ge=0, le=100, description="steps from 1 down to --scale-min (5: 1, 0.95, ..., "
                                                           "0.75)")
    scale_bounds: Literal["joint", "separate"] = Field(
        "separate", description="asymmetric scale search: shrink each end of the range by its own factor of the "
                                "grid ((steps+1)^2 candidates; the default, chosen on brown-val) or both ends by "
                                "one factor (joint)")
    refit_scales: bool = Field(False, description="GPTQ only: once the codes are chosen, re-solve each row's "
                                                  "group scales by least squares on the layer's input Hessian "
                                                  "(same bytes; the layer's output error cannot grow)")
    # --- end scale search ---
    # --- block-wise reconstruction (compress/quant/solve/block_tune.py) ---
    block_tune: bool = Field(False, description="GPTQ only: after each block's solves, train its codes (each may "
                                                "move one step up or down) and group scales so the block's "
                                                "output matches the float block's on the calibration inputs; "
                                                "same format and bytes")
    block_tune_steps: int = Field(100, gt=0, description="block tuning: steps per block")
    block_tune_batch: int = Field(4, gt=0, description="block tuning: calibration sequences per step")
    block_tune_lr: float = Field(0.003, gt=0, description="block tuning: Adam step of the rounding offsets in "
                                                          "code units, decaying linearly to 0")
    block_tune_scale_lr: float = Field(0.002, ge=0, description="block tuning: Adam step of the relative group-scale "
                                                                "change (0: scales stay GPTQ's)")
    block_tune_norm_lr: float = Field(0.0, ge=0, description="block tuning: Adam step of the block's norm weights, "
                                                             "stored unquantized as before (0: they stay the model's)")
    block_tune_target: Literal["quantized", "float"] = Field(
        "float", description="block tuning: the float block's output on the quantized model's inputs "
                                 "(quantized) or on the float model's own (float)")
    block_tune_loss: Literal["mse", "channel"] = Field(
        "channel", description="block tuning: each hidden channel's squared error divided by its mean square in "
                               "the target (channel; a residual stream's energy sits in a few channels), or the "
                               "plain output MSE")
    # --- end block-wise reconstruction ---
    # --- head quantization (compress/quant/solve/head.py) ---
    quantize_head: int | str | None = Field(
        None, description="also GPTQ the untied output head (lm_head) at these bits and group size: 8g128, "
                          "4g64, 8ch (one group per row) or bare bits at --group-size; uniform --bits only; "
                          "a tied head is refused", json_schema_extra={"metavar": "SPEC"})
    # --- end head quantization ---
    calib: TextSpec = Field(DEFAULT_CALIB_TEXT, description="calibration text: " + TEXT_SPEC_HELP)
    text_field: str | None = text_field_option()
    messages_field: str | None = messages_field_option()
    chat_template: bool = chat_template_option()
    samples: int = Field(128, ge=1, description="calibration sequences")
    seq_len: int = Field(512, ge=2, description="tokens per calibration sequence")
    seed: int = Field(0, description="calibration sampling seed (in a recipe: the recipe's seed unless given)")
    batch_size: int = Field(8, ge=1, description="sequences per forward pass")
    device: str = device_option()
    dtype: Dtype = Field("auto", description=STREAM_DTYPE_HELP)
    whole_model: bool = Field(False, description=WHOLE_MODEL_HELP + "; --avg-bits with --sensitivity kl always loads it")
    save_dtype: SaveDtype = Field("fp16", description="dtype of the tensors that stay unquantized")

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: object) -> object:
        """Fill what ``preset`` sets, for the options not given."""
        if not isinstance(data, dict) or data.get("preset") not in PRESETS:
            return data
        return {**data, **{k: v for k, v in PRESETS[data["preset"]].items() if k not in data}}

    @model_validator(mode="after")
    def _request(self) -> QuantizeConfig:
        if (self.bits is None) == (self.avg_bits is None):
            raise ValueError("give exactly one of bits (uniform) or avg_bits (allocated per unit)")
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        if self.group_size is not None and self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (one group per row) or positive, got {self.group_size}")
        if self.method != "gptq" and self.scale_search != "none" and "scale_search" in self.model_fields_set:
            raise ValueError(f"scale_search {self.scale_search} works with method gptq, not {self.method}")
        if self.method != "gptq" and self.refit_scales:
            raise ValueError(f"refit_scales works with method gptq, not {self.method}")
        tune_keys = sorted(k for k, f in type(self).model_fields.items()  # a resolved recipe writes defaults too
                           if k.startswith("block_tune_") and getattr(self, k) != f.default)
        if tune_keys and not self.block_tune:
            raise ValueError(f"{', '.join(tune_keys)} set without block_tune")
        if self.block_tune and self.method != "gptq":
            raise ValueError(f"block_tune starts from GPTQ's codes and runs in its block loop; it does not support "
                             f"method {self.method}")
        if self.sensitivity == "kl-swap" and self.method != "gptq":  # kl-swap
            raise ValueError(f"sensitivity kl-swap solves GPTQ at each candidate: it needs method gptq, not "
                             f"{self.method}")
        if self.refine and (self.avg_bits is None or self.method != "gptq" or self.sensitivity != "loss"):
            raise ValueError("refine re-solves GPTQ's loss per unit: it needs avg_bits with method gptq and "
                             f"sensitivity loss (got avg_bits {self.avg_bits}, method {self.method}, "
                             f"sensitivity {self.sensitivity})")
        cands = self.candidate_pairs()
        if cands is not None and (not cands or any(b not in SUPPORTED_BITS for b, _ in cands)):
            raise ValueError(f"candidates must be among {', '.join(map(str, SUPPORTED_BITS))} bits, got "
                             f"{self.candidates}")
        if cands is not None and any(g != -1 and g <= 0 for _, g in cands):
            raise ValueError(f"candidates: group sizes must be -1 (ch) or positive, got {self.candidates}")
        if self.quantize_head is not None:
            try:
                hb, hg = self.head_pair()
            except ValueError:
                raise ValueError(f"quantize_head: expected e.g. 8g128, 4g64, 8ch or 8, got {self.quantize_head!r}") \
                    from None
            if hb not in SUPPORTED_BITS:
                raise ValueError(f"quantize_head: bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, "
                                 f"got {hb} ({self.quantize_head!r})")
            if hg != -1 and hg <= 0:
                raise ValueError(f"quantize_head: group size must be -1 (ch) or positive, got {self.quantize_head!r}")
            if self.avg_bits is not None:
                raise ValueError("quantize_head works with uniform bits; with avg_bits it is not supported yet")
        return self

    def head_pair(self, group_size: int | None = None) -> tuple[int, int] | None:
        """The head's (bits, group size) from ``quantize_head``; bare bits take ``group_size`` (the
        resolved one, which the plan passes), else this config's own."""
        if self.quantize_head is None:
            return None
        return parse_candidate(self.quantize_head, self._bare_group_size(group_size))

    def distributed_blocker(self) -> str | None:
        """Why these options cannot run data-parallel under torchrun, or None when they can
        (uniform bits, GPTQ or RTN, any ``sequential``; see compress/core/distributed.py)."""
        if self.avg_bits is not None:
            return "--avg-bits (bits chosen per unit) does not run under torchrun; use --bits, or one process"
        if self.block_tune:
            return ("--block-tune does not run under torchrun (it trains each block on the whole calibration set); "
                    "run one process")
        if self.quantize_head is not None:
            return "--quantize-head does not run under torchrun (its Hessian is not shared); run one process"
        return None

    def candidate_list(self) -> list[int]:
        """The candidate bit widths (of the listed pairs, or of the default set); kept for callers of
        the bits-only form — the allocation works on :meth:`candidate_pairs`."""
        return sorted({b for b, _ in (self.candidate_pairs() or DEFAULT_CANDIDATES)})

    def candidate_pairs(self, group_size: int | None = None) -> list[tuple[int, int]] | None:
        """The listed (bits, group size) pairs, bare widths at ``group_size`` (the resolved one,
        which the plan passes), else at this config's own; None = the default set (resolved per model)."""
        return None if self.candidates is None else parse_candidates(self.candidates, self._bare_group_size(group_size))

    def _bare_group_size(self, group_size: int | None) -> int:
        if group_size is not None:
            return group_size
        return UNRESOLVED_GROUP_SIZE if self.group_size is None else self.group_size
