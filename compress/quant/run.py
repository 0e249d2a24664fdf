"""``quantize_checkpoint``: one call from a model to a GPTQ checkpoint, with keyword options.

Usage::

    from layercut.compress.quant.run import quantize_checkpoint
    quantize_checkpoint("bundled:smollm2-135m", "out/q4", bits=4, group_size=64)
    quantize_checkpoint("bundled:smollm2-135m", "out/mix", avg_bits=3.5, candidates=[2, 3, 4, 8])

or ``layercut quantize MODEL -o OUT (--bits B | --avg-bits X) ...``. The options and the
stage itself are :mod:`layercut.compress.stages.quantize`'s (``QuantizeConfig``, ``run``).
"""

from __future__ import annotations

import os

from layercut.compress.errors import LayercutError


def quantize_checkpoint(model: str | os.PathLike, output: str | os.PathLike, *, overwrite: bool = False,
                        progress: bool = True, **options) -> dict:
    """Quantize ``model`` (dir, .gguf or bundled:NAME) into a GPTQ v1 checkpoint at ``output``.

    ``options`` are :class:`layercut.compress.stages.quantize.QuantizeConfig`'s: exactly one of
    ``bits`` (uniform) or ``avg_bits`` (allocated, overhead included), ``group_size``, ...
    Returns a JSON-able report (achieved average bits, per-unit bits, timings).
    """
    from pydantic import ValidationError

    from layercut.compress.stages.base import RunEnv
    from layercut.compress.stages.flags import format_error
    from layercut.compress.stages.quantize import QuantizeConfig, run

    if isinstance(options.get("candidates"), tuple):
        options["candidates"] = list(options["candidates"])
    try:
        config = QuantizeConfig(**options)
    except ValidationError as exc:
        raise LayercutError(f"quantize: {format_error(exc)}") from None
    return run(config, model, output, RunEnv(overwrite=overwrite, progress=progress))
