"""The model card (README.md) of an exported checkpoint, from the run's report.

Usage::

    from layercut.export.card import write_card, build_card
    write_card("runs/demo/04-export/model", report, source_dir, run_dir="runs/demo")
    card = build_card(card_facts(report, source_dir, recipe_text), ref="org/name")   # a ModelCard

A ``huggingface_hub.ModelCard``: metadata through ``ModelCardData`` (``base_model`` and its
``base_model_relation`` where the source is recorded, see :mod:`layercut.export.card_meta`;
``library_name``, ``pipeline_tag``, ``tags``, ``datasets``, ``license``, and ``model-index``
from ``EvalResult`` s); then what was removed or replaced, bits per layer, the data each stage
read, the measured before/after table, task results, plots, the recipe and a loading snippet
for what the folder holds (:mod:`layercut.export.card_usage`). Every number comes from the stage
reports; the speed row is the only line that varies between two runs of the same recipe.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from layercut.export.card_body import bits_table, data_table, recipe_block, stage_lines
from layercut.export.card_meta import base_model_of, data_sources, hub_datasets, relation, source_license
from layercut.export.card_results import eval_results, quality_table, tasks_table
from layercut.export.card_usage import bit_values, folder_kind, report_kind, usage_block

LIBRARY = "transformers"
ORDER = ["base_model", "base_model_relation", "license", "library_name", "pipeline_tag", "tags", "datasets"]
PLACEHOLDER = "path/to/this/folder"  # the snippet's model when the card is written before its folder exists


def provenance(source: str | os.PathLike, model: str | None = None) -> tuple[str | None, str | None]:
    """(base model id, license) of a source checkpoint, only where it is recorded."""
    base = base_model_of(model, source)
    return (base["id"], base["license"]) if base else (None, source_license(source))


def _recipe(recipe_text: str | None) -> dict | None:
    try:
        data = yaml.safe_load(recipe_text) if recipe_text else None
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def card_facts(report: dict, source: str | os.PathLike, recipe_text: str | None = None) -> dict:
    """Collect what the card states from the run report, the recipe and the source's provenance."""
    stages = report.get("stages", [])
    names = [r["stage"] for r in stages]
    last = {r["stage"]: r.get("report") or {} for r in stages}
    quant = last.get("quantize")
    base = base_model_of(report.get("model"), source)
    tags = ["layercut", "compressed"]
    if "prune" in names:
        tags += ["pruned", "depth-pruning"]
    if "heal" in names:
        tags.append("distillation")
    kind = report_kind(quant, last.get("export"))
    if kind != "dense" and quant is None:  # a GPTQ checkpoint exported as it is: its own config tells
        kind = {"gptq-mixed": "gptq-mixed"}.get(folder_kind(source) or "", kind)
    if quant is not None:
        bits = sorted(set(bit_values(quant)))
        tags += ["gptq"] if kind != "dense" else ["gptq-dequantized"]
        tags += ["mixed-precision"] if len(bits) > 1 else [f"{b}-bit" for b in bits]
    sources = data_sources(stages, _recipe(recipe_text))
    license_ = base["license"] if base else source_license(source)
    return {
        "from_run": "layercut_run" in report or "seed" in report,
        "name": report.get("name"),
        "model": report.get("model"),
        "base": base,
        "base_model": base["id"] if base else None,
        "license": license_,
        "relation": relation(names),
        "tags": tags,
        "datasets": hub_datasets(sources),
        "sources": sources,
        "stages": stages,
        "quantize": quant,
        "kind": kind,
        "eval": last.get("eval"),
        "recipe": recipe_text,
    }


def _title(facts: dict) -> str:
    base = facts.get("base_model")
    return facts.get("name") or (f"{base.split('/')[-1]} (compressed with layercut)" if base else "Compressed model")


def card_data(facts: dict) -> tuple[ModelCardData, list[str]]:
    """The card's metadata, and the lm-eval tasks left out of ``model-index``."""
    results, left_out = eval_results(facts.get("eval"))
    data = ModelCardData(
        base_model=facts.get("base_model"),
        base_model_relation=facts["relation"] if facts.get("base_model") else None,  # Hub: adapter, merge, quantized, finetune
        license=facts.get("license"), library_name=LIBRARY, pipeline_tag="text-generation",
        tags=facts["tags"], datasets=facts.get("datasets") or None,
        model_name=_title(facts) if results else None, eval_results=results or None,
    )
    return data, left_out


def _intro(facts: dict) -> list[str]:
    base = facts.get("base")
    if base:
        rev = f" (revision `{base['revision']}`)" if base.get("revision") else ""
        origin = f"[{base['id']}](https://huggingface.co/{base['id']}){rev}"
        if base.get("gguf"):  # the bundled source: a GGUF of the base, dequantized by layercut
            origin += (f" (from layercut's bundled GGUF `{base['gguf']}`, sha256 `{base['gguf_sha256']}`, "
                       "dequantized: its weights carry the GGUF's rounding)")
    else:
        origin = f"`{facts.get('model')}`"
    if facts.get("from_run"):
        return [f"A compressed version of {origin}, produced by layercut with the recipe in `recipe.yaml` "
                "(`layercut run recipe.yaml -o OUT` reproduces it; measured figures are in `report.json`).", ""]
    return [f"Exported by layercut from {origin}.", ""]


def build_card(facts: dict, plots: list[str] | None = None, ref: str = PLACEHOLDER,
               revision: str | None = None) -> ModelCard:
    """The card for ``facts`` (see :func:`card_facts`); ``plots`` are file names beside it;
    ``ref`` is what the usage snippet loads (a local folder, or a repo id after a push)."""
    data, left_out = card_data(facts)
    out = [f"# {_title(facts)}", ""] + _intro(facts) + stage_lines(facts["stages"])
    if facts.get("quantize"):
        out += bits_table(facts["quantize"])
    out += data_table(facts.get("sources") or [], facts["stages"])
    if facts.get("eval"):
        out += quality_table(facts["eval"]) + tasks_table(facts["eval"], left_out)
    for plot in plots or []:
        out += [f"![{Path(plot).stem}]({plot})", ""]
    out += recipe_block(facts.get("recipe"))
    out += ["## Use", "", usage_block(facts["kind"], ref, revision), ""]
    return ModelCard(f"---\n{data.to_yaml(original_order=ORDER)}\n---\n\n" + "\n".join(out))


def render_card(facts: dict, plots: list[str] | None = None, ref: str = PLACEHOLDER) -> str:
    """The README.md text of :func:`build_card`."""
    return str(build_card(facts, plots, ref))


def card_files(report: dict, source: str | os.PathLike, run_dir: str | os.PathLike | None = None, *,
               recipe: str | None = None, folder: str | os.PathLike | None = None,
               ref: str | None = None) -> dict[str, bytes]:
    """README.md and the plots it shows (copied from the stages that made them), as bytes by name.

    ``recipe``: the run's recipe text (default: ``run_dir/recipe.yaml``). ``folder``: the
    checkpoint the card goes into, if it exists (its config decides the usage snippet, its
    absolute path is what the snippet loads unless ``ref`` says otherwise).
    """
    files: dict[str, bytes] = {}
    if run_dir is not None:
        for r in report.get("stages", []):
            plot = (r.get("report") or {}).get("plot")
            if plot and (Path(run_dir) / r["dir"] / plot).is_file():
                files[f"{r['stage']}_{Path(plot).name}"] = (Path(run_dir) / r["dir"] / plot).read_bytes()
        if recipe is None and (Path(run_dir) / "recipe.yaml").is_file():
            recipe = (Path(run_dir) / "recipe.yaml").read_text()
    inside = [r["report"]["checkpoint_plot"] for r in report.get("stages", [])
              if (r.get("report") or {}).get("checkpoint_plot")]
    facts = card_facts(report, source, recipe)
    if folder is not None:
        facts["kind"] = folder_kind(folder) or facts["kind"]
        ref = ref or str(Path(folder).resolve())
    files["README.md"] = render_card(facts, list(files) + inside, ref or PLACEHOLDER).encode()
    return files


def write_card(folder: str | os.PathLike, report: dict, source: str | os.PathLike,
               run_dir: str | os.PathLike | None = None) -> Path:
    """Write README.md (and its plots) into ``folder``, each file atomically."""
    folder = Path(folder)
    recipe = (folder / "recipe.yaml").read_text() if (folder / "recipe.yaml").is_file() else None
    for name, content in card_files(report, source, run_dir, recipe=recipe, folder=folder).items():
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(content)
        os.replace(tmp, folder / name)
    return folder / "README.md"
