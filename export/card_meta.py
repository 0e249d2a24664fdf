"""What a model card's metadata states, each value from a record, never guessed.

Usage::

    from layercut.export.card_meta import base_model_of, relation, data_sources, hub_datasets, eval_results
    base = base_model_of("bundled:smollm2-135m", source_dir)     # {"id": ..., "license": ..., ...} or None

- ``base_model``: the converted bundled model's ``layercut_source.json``; a Hub id source
  (``owner/name[@rev]``, resolved into the local hub cache, whose folder names the repo);
  a layercut-exported checkpoint's own card. A bare local path gets none.
- ``base_model_relation``: ``quantized`` when a quantize stage ran, else ``finetune``. The
  Hub knows adapter, merge, quantized and finetune; a depth-pruned or layer-replaced model
  is a full model whose weights derive from one base (replacement fits new weights on data),
  which is the Hub's ``finetune``, and what the Hub infers anyway when the relation is absent.
- ``datasets``: Hub dataset ids of the ``hf:`` sources that calibration and healing read.
- ``model-index``: perplexity and KL on the eval text, and lm-eval task metrics.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from layercut.calibrate.sources import parse_hf
from layercut.compress.io.models import HUB_ID, source_info

DATA_KEYS = ("calib", "calibration", "data", "text")  # where stage configs and reports name text sources
TRAIN_STAGES = ("score", "prune", "heal", "quantize")
# `datasets` builders that read local files: never a Hub id
LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow", "pandas", "webdataset", "imagefolder", "audiofolder"}
_DATASET_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def _card_meta(folder: Path) -> dict:
    """The metadata of a folder's own README.md (empty if none or unreadable)."""
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    from huggingface_hub import ModelCard

    text = readme.read_text(errors="replace")
    if not text.startswith("---"):  # no metadata block (ModelCard would log a warning)
        return {}
    try:
        return ModelCard(text, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # a foreign README with broken YAML says nothing we can use
        return {}


def hub_snapshot_repo(source: str | os.PathLike) -> tuple[str, str] | None:
    """(repo id, commit) if ``source`` is a snapshot folder of the local hub cache, else None.

    huggingface_hub stores ``owner/name`` under ``models--owner--name/snapshots/<commit>``.
    """
    parts = Path(source).parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    owner, _, name = parts[-3].removeprefix("models--").partition("--")
    return (f"{owner}/{name}", parts[-1]) if owner and name and "--" not in name else None


def base_model_of(model: str | None, source: str | os.PathLike) -> dict | None:
    """{"id", "license", "revision", "via"} of the source's base model where recorded, else None.

    ``model`` is the source as the user gave it (the run report's ``model``); ``source`` the
    local folder it resolved to.
    """
    source = Path(source)
    info = source_info(source)
    meta = _card_meta(source)
    license_ = info.get("license") or meta.get("license")
    if info.get("source"):
        return {"id": info["source"], "license": license_, "revision": None, "via": "bundled",
                "gguf": Path(info["converted_from"]).name if info.get("converted_from") else None,
                "gguf_sha256": info.get("gguf_sha256")}
    snapshot = hub_snapshot_repo(source)
    if snapshot is not None:
        repo, commit = snapshot
        given, _, rev = (model or "").partition("@")
        if HUB_ID.match(model or "") and given != repo:  # the folder is some other repo's snapshot
            return None
        return {"id": repo, "license": license_, "revision": rev or commit, "via": "hub"}
    if "layercut" in (meta.get("tags") or []) and isinstance(meta.get("base_model"), str):
        return {"id": meta["base_model"], "license": license_, "revision": None, "via": "layercut"}
    return None


def source_license(source: str | os.PathLike) -> str | None:
    """The source's license where recorded (its provenance file, else its own card)."""
    return source_info(Path(source)).get("license") or _card_meta(Path(source)).get("license")


def relation(stages: list[str]) -> str | None:
    """``quantized`` if a quantize stage ran, else ``finetune`` if healing, pruning or
    replacement changed the weights; None if no stage did (an export of the source as it is)."""
    if "quantize" in stages:
        return "quantized"
    return "finetune" if {"heal", "prune"} & set(stages) else None


def _sources(value) -> list[str]:
    """Text source strings inside a config/report value (a string, a mix list or a weights dict)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _sources(v)]
    if isinstance(value, dict):
        keyed = [k for k in value if isinstance(k, str) and k.startswith(("hf:", "bundled:"))]
        inner = [s for k, v in value.items() if k in (*DATA_KEYS, "source", "path", "name") for s in _sources(v)]
        return keyed + inner
    return []


def data_sources(stages: list[dict], recipe: dict | None = None) -> list[tuple[str, str]]:
    """(stage, source) for each text a stage read, from the recipe's stage configs and the reports."""
    configs = {}
    for i, entry in enumerate((recipe or {}).get("stages") or [], 1):
        if isinstance(entry, dict) and len(entry) == 1:
            (_, cfg), = entry.items()
            configs[i] = cfg if isinstance(cfg, dict) else {}
    found: list[tuple[str, str]] = []
    for r in stages:
        rep = r.get("report") or {}
        places = [configs.get(r.get("index"), {}), rep, rep.get("config") or {}, rep.get("model") or {}]
        for place in places:
            if not isinstance(place, dict):
                continue
            for key in DATA_KEYS:
                for src in _sources(place.get(key)):
                    if (r["stage"], src) not in found and _is_source(src):
                        found.append((r["stage"], src))
    return found


def _is_source(text: str) -> bool:
    return text.startswith(("hf:", "bundled:")) or text.endswith((".txt", ".gz", ".jsonl", ".json"))


def hub_dataset_id(name: str) -> str | None:
    """``name`` if it can only be a Hub dataset id: not a local folder, file or file builder."""
    if not _DATASET_ID.match(name) or name.lower() in LOCAL_BUILDERS or Path(name).expanduser().exists():
        return None
    return name


def hub_datasets(sources: list[tuple[str, str]]) -> list[str]:
    """Hub dataset ids that calibration or healing read (eval texts are results, not training data)."""
    out = []
    for stage, src in sources:
        if stage in TRAIN_STAGES and src.startswith("hf:"):
            ds = hub_dataset_id(parse_hf(src.removeprefix("hf:"))[0])
            if ds and ds not in out:
                out.append(ds)
    return out
