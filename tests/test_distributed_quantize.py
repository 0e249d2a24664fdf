"""Data-parallel GPTQ calibration under torchrun on CPU (gloo): 2 processes write the same bytes as 1.

Why they can agree exactly: both runs draw the same calibration set; the 2-process run deals its
micro-batches (``--batch-size`` consecutive sequences) round-robin, so each micro-batch is the very
tensor one process runs, through identical blocks (by induction over blocks), with one thread per
process in both runs. After every round the two micro-batch Hessians (float32 2/m Σ x xᵀ) are
all-gathered and folded into the float64 running mean in global micro-batch order, the order one
process folds them in; so H, every solve and every packed tensor are bit-identical.
9 sequences in micro-batches of 2 give 5 micro-batches: rank 0 runs 3 (the last of one sequence),
rank 1 runs 2 and takes part in one round with nothing of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layercut.compress.core.distributed import Group
from tests.plain_solver import plain_solver

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--bits", "4", "--group-size", "32", "--samples", "9", "--seq-len", "32", "--batch-size", "2",
        "--device", "cpu", "--json"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=cwd)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_two_processes_write_the_bytes_of_one(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    model = tiny_model_dir("llama")
    one = _run([sys.executable, "-m", "layercut", "-q", "quantize", str(model), "-o", str(tmp_path / "one"), *ARGS],
               tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run([*TORCHRUN, "-m", "layercut", "-q", "quantize", str(model), "-o", str(tmp_path / "two"), *ARGS],
               tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    reports = [json.loads(line) for line in two.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["processes"] == 2  # rank 0 alone reports
    assert reports[0]["tokens"] == json.loads(one.stdout.splitlines()[-1])["tokens"] == 9 * 32  # all, not a share
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no temporary folder left

    a, b = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert a.keys() == b.keys() and any(k.endswith(".safetensors") for k in a)
    for name in a:
        if name.endswith(".safetensors"):
            ta, tb = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
            assert ta.keys() == tb.keys()
            for k in ta:
                assert torch.equal(ta[k], tb[k]), k
        assert a[name] == b[name], name  # every file byte for byte (quantize.json included)


def test_gathered_hessians_are_bit_identical(tmp_path):
    """Every block's gathered Hessians (sublayer collection, a padded tail, an empty round on rank 1)
    equal a single process's bit for bit: red if the fold order or the token counts were off."""
    proc = _run([*TORCHRUN, str(ROOT / "tests" / "dist_hessian_worker.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["hessians"] == 6 * 4 and report["identical"], report
    assert report["plain_reduction_max_rel_diff"] < 1e-12  # what a plain all_reduce would cost: rounding only


def test_a_share_alone_gives_other_codes(tiny_model_dir):
    """What the comparison above guards against: a rank solving on its own share of the Hessian
    (no gather) writes other codes, so the byte comparison turns red."""
    from layercut.calibrate.data import CalibSet, calibration_batch
    from layercut.compress.io.models import load_model
    from layercut.compress.quant.solve.driver import quantize_model

    model_dir = tiny_model_dir("llama")
    cfg = plain_solver(bits=4, group_size=32)
    full = None
    for share in (False, True):
        model, tok = load_model(model_dir)
        calib = calibration_batch(tok, "bundled:brown-calib", samples=9, seq_len=32, seed=0)
        if share:
            rows = Group(rank=0, world=2, local_rank=0, device=torch.device("cpu")).shard_rows(9, 2)
            assert rows.tolist() == [0, 1, 4, 5, 8]
            calib = CalibSet(calib.input_ids[rows], calib.attention_mask[rows])
        result = quantize_model(model, calib, cfg, batch_size=2, progress=False)
        codes = {n: q.tensors["qweight"] for n, q in result.layers.items()}
        if full is None:
            full = codes
    assert codes.keys() == full.keys()
    assert not all(torch.equal(codes[n], full[n]) for n in codes)


def test_ranks_that_disagree_on_the_text_write_nothing(tiny_model_dir, tmp_path):
    """Same options and paths, but each rank reads a different calib.txt (its own working
    directory): one error line from rank 0, both ranks exit 2, no output. (torchrun stops the other
    rank with SIGTERM once one has failed: the launcher ignores it, so each rank records its own code.)"""
    model = tiny_model_dir("llama")
    text = "The quick brown fox jumps over the lazy dog near the river bank today. " * 40
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
        (tmp_path / str(rank) / "calib.txt").write_text(text if rank == 0 else text.upper())
    launcher = tmp_path / "per_rank_cwd.py"
    launcher.write_text("import os, signal, sys\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        "os.chdir(os.environ['RANK'])\nfrom layercut.cli import main\ncode = main(sys.argv[1:])\n"
                        "open('exit-code', 'w').write(str(code))\nsys.exit(code)\n")
    out = tmp_path / "out"
    proc = _run([*TORCHRUN, str(launcher), "-q", "quantize", str(model), "-o", str(out), "--calib", "calib.txt",
                 *ARGS], tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "disagree on the calibration tokens" in errors[0] and "rank 1" in errors[0], \
        proc.stderr[-3000:]
    assert [(tmp_path / str(r) / "exit-code").read_text() for r in (0, 1)] == ["2", "2"], proc.stderr[-3000:]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "per_rank_cwd.py"]


def test_options_that_do_not_run_distributed_say_so():
    from layercut.compress.quant.config import QuantizeConfig

    assert QuantizeConfig(bits=4).distributed_blocker() is None
    assert QuantizeConfig(bits=4, method="rtn", sequential="linear").distributed_blocker() is None
    assert "--block-tune" in QuantizeConfig(bits=4, block_tune=True).distributed_blocker()
    assert "--avg-bits" in QuantizeConfig(avg_bits=3.5).distributed_blocker()
    assert "--quantize-head" in QuantizeConfig(bits=4, quantize_head="8g32").distributed_blocker()


@pytest.mark.parametrize("n, b, world, rank, rows", [(9, 2, 2, 1, [2, 3, 6, 7]), (6, 2, 3, 2, [4, 5])])
def test_shard_rows(n, b, world, rank, rows):
    assert Group(rank=rank, world=world, local_rank=rank, device=torch.device("cpu")).shard_rows(n, b).tolist() == rows
