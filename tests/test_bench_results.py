"""benchmarks/_results.py: a benchmark's JSON keeps the rows it did not rerun, also when two runs
of one benchmark (one per core) write the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _write_merged():
    spec = importlib.util.spec_from_file_location("bench_results", REPO / "benchmarks" / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_merged


def test_rows_merge_against_the_file_at_write_time(tmp_path):
    write_merged = _write_merged()
    path = tmp_path / "r.json"
    # two runs that both started before the other wrote: each carries only its own rows
    write_merged(path, {"setup": {"seeds": "0"}, "runs": {"a/seed0": 1.0}}, rows="runs")
    write_merged(path, {"setup": {"seeds": "1"}, "runs": {"a/seed1": 2.0, "a/seed0": 1.5}}, rows="runs")
    data = json.loads(path.read_text())
    assert data["runs"] == {"a/seed0": 1.5, "a/seed1": 2.0}  # the later row wins, none is dropped
    assert data["setup"] == {"seeds": "1"}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


def test_without_rows_a_key_is_replaced_whole(tmp_path):
    write_merged = _write_merged()
    path = tmp_path / "r.json"
    write_merged(path, {"runs": {"a": 1}, "timing": {"x": 1}})
    write_merged(path, {"runs": {"b": 2}})
    assert json.loads(path.read_text()) == {"runs": {"b": 2}, "timing": {"x": 1}}
