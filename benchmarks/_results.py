"""Write a benchmark's results JSON without losing what it did not rerun.

``write_merged(path, result)``: the stored JSON's top-level keys that ``result`` does not carry
(a ``timing`` section written by another mode, notes, rows kept under their own key) stay as
stored; the keys ``result`` carries replace theirs. Written atomically (temp file + rename).

``rows="runs"``: that key is merged row by row instead, against the file as it is at write time,
so two runs of one benchmark (one per core, other seeds) can write the same file without either
dropping the other's rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_merged(path: str | os.PathLike, result: dict, indent: int = 1, rows: str | None = None, **dump) -> dict:
    path = Path(path)
    stored = json.loads(path.read_text()) if path.is_file() else {}
    merged = {**stored, **result}
    if rows is not None:
        merged[rows] = {**stored.get(rows, {}), **result.get(rows, {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=indent, **dump) + "\n")
    os.replace(tmp, path)
    return merged
