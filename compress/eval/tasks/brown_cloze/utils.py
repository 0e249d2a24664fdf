"""Loader of the brown_cloze data: the jsonl beside this file, read in memory (no network, no cache)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str], **_metadata):
    """lm-eval's ``custom_dataset`` hook: ``{split: file}`` (relative to this folder) -> a DatasetDict."""
    import datasets

    splits = {}
    for split, name in data_files.items():
        with open(HERE / name, encoding="utf-8") as fh:
            splits[split] = datasets.Dataset.from_list([json.loads(line) for line in fh if line.strip()])
    return datasets.DatasetDict(splits)
