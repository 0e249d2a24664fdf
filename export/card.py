"""The model card (README.md) of an exported checkpoint, from the run's report.

Usage::

    from export.card import write_card, render_card
    write_card("runs/demo/05-export/model", report, source_dir, run_dir="runs/demo")
    text = render_card(card_facts(report, source_dir))      # pure: facts -> markdown

YAML front matter (``base_model``, ``base_model_relation``, ``library_name``,
``pipeline_tag``, ``tags``, ``license``; base model and license only where the source's
provenance says so, never guessed), then what was removed or replaced, bits per layer,
and the measured before/after perplexity, KL, size and speed, with the layer plot.
Every number comes from the stage reports; the speed row is the only line that varies
between two runs of the same recipe.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from compress.models import source_info

LIBRARY = "transformers"


def _source_card_meta(source: Path) -> dict:
    """Front matter of the source's own README.md, if it has one."""
    readme = Path(source) / "README.md"
    if not readme.is_file():
        return {}
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return {}
    try:
        meta = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return meta if isinstance(meta, dict) else {}


def provenance(source: str | os.PathLike) -> tuple[str | None, str | None]:
    """(base model id, license) of a source checkpoint, only where it is recorded.

    layercut's converted bundled models carry ``layercut_source.json``; a checkpoint that
    layercut exported carries them in its card's front matter (tag ``layercut``); any other
    model's README gives its license (its own repo id is not recorded in its files).
    """
    info = source_info(Path(source))
    meta = _source_card_meta(Path(source))
    base = info.get("source")
    if base is None and "layercut" in (meta.get("tags") or []):
        base = meta.get("base_model")
    return base, info.get("license") or meta.get("license")


def card_facts(report: dict, source: str | os.PathLike) -> dict:
    """Collect what the card states from the run report and the source's provenance."""
    base, license_ = provenance(source)
    stages = report.get("stages", [])
    by = {}
    for r in stages:
        by.setdefault(r["stage"], []).append(r)
    quant = by.get("quantize", [{}])[-1].get("report") if "quantize" in by else None
    evals = [r["report"] for r in by.get("eval", [])]
    relation = "quantized" if quant else "finetune"
    tags = ["layercut", "compressed"]
    if "prune" in by:
        tags += ["pruned", "depth-pruning"]
    if "heal" in by:
        tags.append("distillation")
    if quant:
        tags += ["gptq", "mixed-precision"] if len(set(_bits_values(quant))) > 1 else ["gptq", f"{_bits_values(quant)[0]}-bit"]
    return {
        "from_run": "layercut_run" in report or "seed" in report,
        "name": report.get("name"),
        "model": report.get("model"),
        "base_model": base,
        "license": license_,
        "relation": relation,
        "tags": tags,
        "stages": stages,
        "quantize": quant,
        "eval": evals[-1] if evals else None,
    }


def _bits_values(quant: dict) -> list[int]:
    bits = quant.get("bits_per_layer") or {}
    values = list(bits.values()) if isinstance(bits, dict) else list(bits)
    flat = [v for x in values for v in (x.values() if isinstance(x, dict) else [x])]
    return flat or [quant.get("bits", 0)]


def front_matter(facts: dict) -> str:
    meta: dict = {}
    if facts.get("base_model"):
        meta["base_model"] = facts["base_model"]
        meta["base_model_relation"] = facts["relation"]
    meta["library_name"] = LIBRARY
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = facts["tags"]
    if facts.get("license"):
        meta["license"] = facts["license"]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _stage_line(r: dict) -> str | None:
    rep, stage = r.get("report", {}), r["stage"]
    if stage == "prune":
        return f"- **prune**: {rep.get('description') or rep.get('transform', '')}"
    if stage == "heal":
        loss = ""
        if rep.get("loss_start") is not None and rep.get("loss_end") is not None:
            k = rep.get("loss_window", 1)
            loss = f", loss {rep['loss_start']:.4g} → {rep['loss_end']:.4g} (mean of the first / last {k} steps)"
        return f"- **heal**: LoRA distillation from the source model, {rep.get('steps', '?')} steps{loss}, merged into dense weights"
    if stage == "quantize":
        return f"- **quantize**: {rep.get('description') or 'GPTQ,'} {rep.get('avg_bits', float('nan')):.2f} bits per weight on average (scales and zeros included)"
    if stage == "score":
        return f"- **score**: layer importance ({', '.join(rep.get('methods', []))})"
    if stage == "export":
        kind = "dequantized to dense" if rep.get("dequantized") else ("GPTQ packing" if rep.get("quantized") else "dense")
        return f"- **export**: safetensors ({kind})"
    return None


def _bits_table(quant: dict) -> list[str]:
    """Bits per allocation unit; runs of consecutive layers with equal bits share a row."""
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
    runs: list[list] = []  # [prefix, first, last, bits] for names like model.layers.7
    for name, b in items:
        prefix, _, index = str(name).rpartition(".")
        if index.isdigit() and runs and runs[-1][0] == prefix and runs[-1][3] == b and runs[-1][2] == int(index) - 1:
            runs[-1][2] = int(index)
        else:
            runs.append([prefix, int(index), int(index), b] if index.isdigit() else [None, name, name, b])
    lines += ["| layers | bits |", "|---|---|"]
    for prefix, first, last, b in runs:
        span = str(first) if first == last else f"{first}–{last}"
        where = span if not prefix else f"{prefix}.{span}"
        lines.append(f"| {where} | {b} |")
    return lines + [""]


def _fmt(value, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value / scale:{spec}}{unit}"


def _quality_table(ev: dict) -> list[str]:
    m, b = ev["model"], ev.get("baseline") or {}
    lines = [
        "## Quality, size and speed",
        "",
        f"Measured with `layercut eval` on `{m.get('text')}` ({m.get('tokens')} scored tokens, context {m.get('ctx')}); "
        "KL is the mean KL(p_source ‖ p_compressed) per token, in nats.",
        "",
        "| | source | compressed |",
        "|---|---:|---:|",
        f"| perplexity | {_fmt(b.get('ppl') or m.get('reference_ppl'), '.3f')} | {_fmt(m.get('ppl'), '.3f')} |",
        f"| KL to source | 0 | {_fmt(m.get('kl'), '.4f')} |",
        f"| parameters | {_fmt(b.get('params'), '.1f', 1e6, ' M')} | {_fmt(m.get('params'), '.1f', 1e6, ' M')} |",
        f"| weights on disk | {_fmt(b.get('bytes'), '.1f', 2**20, ' MiB')} | {_fmt(m.get('bytes'), '.1f', 2**20, ' MiB')} |",
        f"| tokens/s (this run's machine) | {_fmt(b.get('tokens_per_s'), '.0f')} | {_fmt(m.get('tokens_per_s'), '.0f')} |",
    ]
    for g in ev.get("gates", []):
        limit = f"{g['limit']:.4g}" if g["name"] == "max_kl" else f"{g['limit']:.0%}"
        value = "–" if g["value"] is None else (f"{g['value']:.4f}" if g["name"] == "max_kl" else f"{g['value']:+.1%}")
        lines.append(f"| gate: {g['name'].replace('_', ' ')} ≤ {limit} | | {value}, {'passed' if g['passed'] else 'FAILED'} |")
    return lines + [""]


def render_card(facts: dict, plots: list[str] | None = None) -> str:
    """The README.md text for ``facts`` (see :func:`card_facts`); ``plots`` are file names beside it."""
    base = facts.get("base_model")
    title = facts.get("name") or (f"{base.split('/')[-1]} (compressed with layercut)" if base else "Compressed model")
    out = [front_matter(facts), f"# {title}", ""]
    origin = f"[{base}](https://huggingface.co/{base})" if base else f"`{facts.get('model')}`"
    if facts.get("from_run"):
        out += [f"A compressed version of {origin}, produced by layercut with the recipe in `recipe.yaml` "
                "(`layercut run recipe.yaml -o OUT` reproduces it; measured figures are in `report.json`).", ""]
    else:
        out += [f"Exported by layercut from {origin}.", ""]
    lines = [line for r in facts["stages"] if (line := _stage_line(r))]
    if lines:
        out += ["## What was done", ""] + lines + [""]
    if facts.get("quantize"):
        out += _bits_table(facts["quantize"])
    if facts.get("eval"):
        out += _quality_table(facts["eval"])
    for plot in plots or []:
        out += [f"![{Path(plot).stem}]({plot})", ""]
    loader = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
              "model = AutoModelForCausalLM.from_pretrained(\"PATH\")\n"
              "tokenizer = AutoTokenizer.from_pretrained(\"PATH\")")
    if facts.get("quantize") and not any(r["stage"] == "export" and r["report"].get("dequantized")
                                         for r in facts["stages"]):
        loader = ("# GPTQ v1 checkpoint with per-module bits (GPTQModel `dynamic`): load with GPTQModel or vLLM\n"
                  "from gptqmodel import GPTQModel\nmodel = GPTQModel.load(\"PATH\")")
    out += ["## Use", "", "```python", loader, "```", ""]
    return "\n".join(out)


def card_files(report: dict, source: str | os.PathLike, run_dir: str | os.PathLike | None = None) -> dict[str, bytes]:
    """README.md and the plots it shows (copied from the stages that made them), as bytes by name."""
    files: dict[str, bytes] = {}
    if run_dir is not None:
        for r in report.get("stages", []):
            plot = r.get("report", {}).get("plot")
            if plot and (Path(run_dir) / r["dir"] / plot).is_file():
                files[f"{r['stage']}_{Path(plot).name}"] = (Path(run_dir) / r["dir"] / plot).read_bytes()
    inside = [r["report"]["checkpoint_plot"] for r in report.get("stages", [])
              if r.get("report", {}).get("checkpoint_plot")]
    files["README.md"] = render_card(card_facts(report, source), list(files) + inside).encode()
    return files


def write_card(folder: str | os.PathLike, report: dict, source: str | os.PathLike,
               run_dir: str | os.PathLike | None = None) -> Path:
    """Write README.md (and its plots) into ``folder``, each file atomically."""
    folder = Path(folder)
    for name, content in card_files(report, source, run_dir).items():
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(content)
        os.replace(tmp, folder / name)
    return folder / "README.md"
