"""Markdown sections of a model card: what was done, bits per layer, data, recipe.

Usage::

    from layercut.export.card_body import stage_lines, bits_table, data_table, recipe_block
    lines = stage_lines(report["stages"])           # "- **prune**: ..." per stage

Every number is read from a stage report; nothing here measures anything.
"""

from __future__ import annotations

from layercut.calibrate.sources import parse_hf
from layercut.export.card_meta import hub_dataset_id
from layercut.export.card_results import bundled_text_name

USE = {"score": "calibration (layer scores)", "prune": "calibration (layer selection and fit)",
       "heal": "healing (distillation training)", "quantize": "calibration (GPTQ)", "eval": "evaluation"}


def _stage_line(r: dict) -> str | None:
    rep, stage = r.get("report") or {}, r["stage"]
    if stage == "prune":
        return f"- **prune**: {rep.get('description') or rep.get('transform', '')}"
    if stage == "heal":
        loss = ""
        if rep.get("loss_start") is not None and rep.get("loss_end") is not None:
            k = rep.get("loss_window", 1)
            loss = f", loss {rep['loss_start']:.4g} → {rep['loss_end']:.4g} (mean of the first / last {k} steps)"
        if rep.get("targets") == ["scales"]:
            return (f"- **heal**: the GPTQ group scales tuned by distillation from the source model, "
                    f"{rep.get('steps', '?')} steps{loss}; codes, zeros and bytes as quantized")
        return f"- **heal**: LoRA distillation from the source model, {rep.get('steps', '?')} steps{loss}, merged into dense weights"
    if stage == "quantize":
        return f"- **quantize**: {rep.get('description') or 'GPTQ,'} {rep.get('avg_bits', float('nan')):.2f} bits per weight on average (scales and zeros included)"
    if stage == "score":
        return f"- **score**: layer importance ({', '.join(rep.get('methods', []))})"
    if stage == "export":
        kind = "dequantized to dense" if rep.get("dequantized") else ("GPTQ packing" if rep.get("quantized") else "dense")
        return f"- **export**: safetensors ({kind})"
    return None


def stage_lines(stages: list[dict]) -> list[str]:
    """The "What was done" section (empty if no stage says anything)."""
    lines = [line for r in stages if (line := _stage_line(r))]
    return ["## What was done", ""] + lines + [""] if lines else []


def bits_table(quant: dict) -> list[str]:
    """Bits (and group size, for "3g64"-style labels) per allocation unit; runs of consecutive
    layers with the same configuration share a row."""
    bits = quant.get("bits_per_layer")
    if not bits:
        return []
    lines = ["## Bits per layer", ""]
    if isinstance(bits, dict) and all(isinstance(v, dict) for v in bits.values()):
        cols = list(dict.fromkeys(k for v in bits.values() for k in v))
        lines += ["| layer | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        lines += [f"| {layer} | " + " | ".join(str(v.get(c, "")) for c in cols) + " |" for layer, v in bits.items()]
        return lines + [""]
    items = list(bits.items()) if isinstance(bits, dict) else list(enumerate(bits))
    grouped = _by_layer(items)
    if grouped is not None:  # units like model.layers.7.qkv: one row per run of equal layers, a column per kind
        cols = list(dict.fromkeys(k for _, row in grouped for k in row))
        rows: list[list] = []  # [prefix, first, last, row]
        for (prefix, index), row in grouped:
            if rows and rows[-1][0] == prefix and rows[-1][3] == row and rows[-1][2] == index - 1:
                rows[-1][2] = index
            else:
                rows.append([prefix, index, index, row])
        lines += ["| layers | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for prefix, first, last, row in rows:
            span = str(first) if first == last else f"{first}–{last}"
            lines.append(f"| {prefix}.{span} | " + " | ".join(_pair_text(row.get(c, "")) for c in cols) + " |")
        if any(_pair_text(v) != str(v) for _, row in grouped for v in row.values()):
            lines += ["", "Entries are bits (group size)."]
        return lines + [""]
    runs: list[list] = []  # [prefix, first, last, bits] for names like model.layers.7
    for name, b in items:
        prefix, _, index = str(name).rpartition(".")
        if index.isdigit() and runs and runs[-1][0] == prefix and runs[-1][3] == b and runs[-1][2] == int(index) - 1:
            runs[-1][2] = int(index)
        else:
            runs.append([prefix, int(index), int(index), b] if index.isdigit() else [None, name, name, b])
    pairs = any(isinstance(b, str) and _pair_text(b) != b for _, _, _, b in runs)  # "3g64" / "4ch" labels
    lines += ["| layers | bits (group size) |" if pairs else "| layers | bits |", "|---|---|"]
    for prefix, first, last, b in runs:
        span = str(first) if first == last else f"{first}–{last}"
        where = span if not prefix else f"{prefix}.{span}"
        lines.append(f"| {where} | {_pair_text(b) if pairs else b} |")
    return lines + [""]


def _by_layer(items: list) -> list[tuple[tuple[str, int], dict]] | None:
    """[((prefix, layer), {kind: value})] if every name is ``prefix.<layer>.<kind>``, else None."""
    out: dict[tuple[str, int], dict] = {}
    for name, value in items:
        head, _, kind = str(name).rpartition(".")
        prefix, _, index = head.rpartition(".")
        if not (prefix and index.isdigit() and kind) or kind.isdigit():
            return None
        out.setdefault((prefix, int(index)), {})[kind] = value
    return list(out.items())


def _pair_text(label) -> str:
    """A quantize report's ``"3g64"`` -> ``"3 (64)"``, ``"4ch"`` -> ``"4 (per channel)"``; else as is."""
    text = str(label)
    bits, sep, rest = text.partition("g")
    if sep and bits.isdigit() and rest.isdigit():
        return f"{bits} ({rest})"
    if text.endswith("ch") and text[:-2].isdigit():
        return f"{text[:-2]} (per channel)"
    return text


def describe_source(src: str) -> str:
    """A text source for the body: Hub datasets linked, bundled and local texts named as such."""
    if src.startswith("hf:"):
        name = parse_hf(src.removeprefix("hf:"))[0]
        if hub_dataset_id(name):
            return f"[`{src}`](https://huggingface.co/datasets/{name}) (Hub dataset)"
        return f"`{src}` (local dataset, not on the Hub)"
    if src.startswith("bundled:"):
        return f"`{src}`: {bundled_text_name(src)}"
    return f"`{src}` (local file, not on the Hub)"


def _amount(stage: str, rep: dict) -> str:
    calib = rep.get("calibration") if isinstance(rep.get("calibration"), dict) else rep
    if stage == "eval" and (rep.get("model") or {}).get("tokens"):
        return f"{rep['model']['tokens']} scored tokens"
    if stage == "heal" and rep.get("tokens"):
        return f"{rep['tokens']} tokens"
    if calib.get("samples") and calib.get("seq_len"):
        return f"{calib['samples']} × {calib['seq_len']} tokens"
    return "–"


def data_table(sources: list[tuple[str, str]], stages: list[dict]) -> list[str]:
    """Which text each stage read, how much, and whether it is a Hub dataset."""
    if not sources:
        return []
    reports = {r["stage"]: r.get("report") or {} for r in stages}
    lines = ["## Data", "", "| stage | used for | text | amount |", "|---|---|---|---|"]
    for stage, src in sources:
        lines.append(f"| {stage} | {USE.get(stage, '–')} | {describe_source(src)} | {_amount(stage, reports.get(stage, {}))} |")
    return lines + [""]


def recipe_block(recipe_text: str | None) -> list[str]:
    """The recipe the run came from, verbatim, as a YAML block."""
    if not recipe_text:
        return []
    return ["## Recipe", "", "`layercut run recipe.yaml -o OUT` reproduces this model (the file is beside this card).",
            "", "<details><summary>recipe.yaml</summary>", "", "```yaml", recipe_text.rstrip("\n"), "```", "",
            "</details>", ""]
