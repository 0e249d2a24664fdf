"""Data-parallel healing through ``accelerate launch`` on CPU (gloo): 2 processes at batch 1 see
the same global batches as 1 process at batch 2, so their loss curves agree.

Why they can agree exactly up to float rounding: the heal data (``--samples``) and the
training order (``sample_order(samples, steps × batch × processes, seed)``) are the same in
both runs; accelerate deals whole per-process batches round-robin, so step s of the 2-process
run covers items 2s and 2s+1, which form step s of the 1-process run; DDP averages the two
processes' gradients, and with full windows (no padding: equal token counts) that average is
the 1-process batch mean; dropout is off. What remains is summation order (the all-reduce, a
batch-of-2 matmul against two batch-of-1 matmuls): a relative tolerance of 1e-4 on every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from layercut.compress.depth.blocks import drop_blocks


def _heal_argv(student, teacher, out, batch: int) -> list[str]:
    return ["heal", str(student), "--teacher", str(teacher), "-o", str(out), "--steps", "4", "--samples", "8",
            "--seq-len", "24", "--batch-size", str(batch), "--rank", "4", "--dropout", "0", "--lr", "1e-3",
            "--data-offset", "0", "--device", "cpu", "--json"]


def _run(argv: list[str], tmp_path, out) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 4
    return json.loads((out / "heal.json").read_text())  # the per-step losses


def test_two_process_gloo_heal_matches_one_process(tiny_model_dir, tmp_path):
    from layercut.compress.io.models import load_model

    src = tiny_model_dir("llama")
    student = tmp_path / "pruned"
    model, tok = load_model(src)
    model = drop_blocks(model, [1, 2])
    model.save_pretrained(student)
    tok.save_pretrained(student)

    one = _run([sys.executable, "-m", "layercut.cli", *_heal_argv(student, src, tmp_path / "one", batch=2)], tmp_path,
               tmp_path / "one")
    # accelerate's distributed launcher (torchrun underneath; its --cpu flag would start ONE process); with
    # --device cpu the processes form a gloo group on the CPU
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "layercut.cli"]
    two = _run([*launcher, *_heal_argv(student, src, tmp_path / "two", batch=1)], tmp_path, tmp_path / "two")

    assert len(one["losses"]) == len(two["losses"]) == 4
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert one["losses"][-1] < one["losses"][0]  # it trained (a flat curve would match trivially)
    a = load_model(tmp_path / "one")[0].state_dict()
    b = load_model(tmp_path / "two")[0].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
