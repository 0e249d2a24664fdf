"""Data-parallel GPTQ calibration: ``layercut quantize`` in 1 process vs ``torchrun`` with 2 (gloo, CPU).

Run::

    .venv/bin/python benchmarks/distributed_quantize.py                      # 8 blocks, hidden 256, 32 x 256 tokens
    .venv/bin/python benchmarks/distributed_quantize.py --layers 12 --hidden 512 --samples 64

A random Llama (from config, seed 0) and a 384-token BPE tokenizer trained on a slice of
``bundled:brown-calib`` are written to a temporary folder; each configuration is one subprocess
of the real command with ``OMP_NUM_THREADS=1`` per process (so 2 processes use 2 cores, 1 uses 1):
``-m layercut quantize`` and ``-m torch.distributed.run --standalone --nproc-per-node 2 -m layercut
quantize``. "wall s" is the whole command (interpreter start-up and imports included), "run s" the
stage's own ``seconds`` (load, calibration draw, blocks, write), "solve s" the GPTQ solves inside it
(every rank solves every linear, so that part does not shrink). The outputs are compared file by
file ("same bytes"). The 1-minute load average before the runs is printed and stored: on a 2-core
machine that is busy elsewhere the 2 processes share cores, and the comparison says little. Prints a table and writes ``benchmarks/results/distributed_quantize.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def build_model(folder: Path, layers: int, hidden: int, seed: int = 0) -> None:
    import torch
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from layercut.calibrate.data import load_texts

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(load_texts("bundled:brown-calib")[:40], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                     unk_token="<unk>")
    torch.manual_seed(seed)
    config = T.LlamaConfig(vocab_size=384, hidden_size=hidden, intermediate_size=3 * hidden,
                           num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), head_dim=64,
                           num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    fast.save_pretrained(folder)


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def run(processes: int, model: Path, out: Path, args: argparse.Namespace) -> dict:
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    argv = [*launcher, "-m", "layercut", "-q", "quantize", str(model), "-o", str(out), "--bits", "4",
            "--group-size", "64", "--samples", str(args.samples), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--device", "cpu", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"processes": processes, "wall_s": round(wall, 2), "run_s": round(report["seconds"], 2),
            "solve_s": round(report["solve_seconds"], 2), "tokens": report["tokens"], "sha256": digest(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    load = os.getloadavg()[0]  # other work on the machine: 2 processes need 2 idle cores
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model, args.layers, args.hidden)
        rows = [run(n, model, Path(tmp) / f"out{n}", args) for n in (1, 2)]
    same = rows[0]["sha256"] == rows[1]["sha256"]
    print(f"random Llama: {args.layers} blocks, hidden {args.hidden}; calibration {args.samples} x {args.seq_len} "
          f"tokens in micro-batches of {args.batch_size}; OMP_NUM_THREADS=1 per process; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, 1-min load average {load:.2f} before the runs")
    print(f"{'processes':>9} {'wall s':>8} {'run s':>8} {'solve s':>8} {'tokens':>7}")
    for r in rows:
        print(f"{r['processes']:>9} {r['wall_s']:>8.2f} {r['run_s']:>8.2f} {r['solve_s']:>8.2f} {r['tokens']:>7}")
    print(f"speed-up (run s): {rows[0]['run_s'] / rows[1]['run_s']:.2f}x; outputs byte-identical: {same}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import write_merged  # benchmarks/_results.py

    meta = {"layers": args.layers, "hidden": args.hidden, "samples": args.samples, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "threads_per_process": 1, "cpus": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(), "load_average_before": round(load, 2)}
    write_merged(RESULTS / "distributed_quantize.json", {"meta": meta, "rows": rows, "byte_identical": same})


if __name__ == "__main__":
    main()
