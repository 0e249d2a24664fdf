"""Gate-Norm throughput on a synthetic multi-GB checkpoint vs. a plain sequential read.

Usage::

    .venv/bin/python benchmarks/gate_norm.py                  # 4 Llama-7B layers, ~1.6 GB bf16
    .venv/bin/python benchmarks/gate_norm.py --layers 12 --no-mlp --kv-heads 8

Writes a 2-shard safetensors checkpoint (index + config.json) of random bf16 Llama-7B
layers (hidden 4096, 32 heads of 128, MLP 11008; ``--kv-heads`` for GQA, ``--no-mlp`` for
attention only), so q+k are the same ~17 % of the bytes as in the real model,
then times, cold (the files' pages dropped with posix_fadvise DONTNEED after fsync) and
warm (page cache):

* ``plain read``  — every byte of every shard, sequentially, 16 MiB reads;
* ``gate-norm``   — :func:`layercut.compress.select.gate_norm.gate_norm_scores` on the directory
  (reads only q and k, converts to fp32, d_h×d_h Grams, next layer read ahead);
* ``qk read only`` / ``grams only`` — its two halves alone (I/O floor, compute floor).

Throughput is reported both over the bytes gate-norm needs (q+k) and over the whole
checkpoint. Prints a table, writes benchmarks/results/gate_norm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from layercut.compress.select.cores import gate_norm_qk  # noqa: E402
from layercut.compress.select.gate_norm import gate_norm_scores  # noqa: E402


def write_checkpoint(folder: Path, layers: int, hidden: int, heads: int, kv_heads: int, mlp: int) -> dict:
    head_dim = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "num_hidden_layers": layers, "intermediate_size": mlp, "vocab_size": 32000}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    if mlp:
        shapes.update({"mlp.gate_proj": (mlp, hidden), "mlp.up_proj": (mlp, hidden), "mlp.down_proj": (hidden, mlp)})
    weight_map, half = {}, (layers + 1) // 2
    for shard, chunk in enumerate((range(half), range(half, layers))):
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        tensors = {}
        for i in chunk:
            for proj, shape in shapes.items():
                key = f"model.layers.{i}.{proj if proj.startswith('mlp.') else 'self_attn.' + proj}.weight"
                tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                weight_map[key] = name
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return config


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (only these files; no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(files: list[Path]) -> int:
    buf = bytearray(16 << 20)
    total = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total


def qk_read_only(folder: Path, layers: int) -> int:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    total = 0
    for i in range(layers):
        for proj in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            with safe_open(str(folder / index[key]), framework="pt") as fh:
                total += fh.get_tensor(key).float().numel()
    return total


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=11008, help="MLP width (Llama-7B 11008)")
    ap.add_argument("--no-mlp", action="store_true", help="attention projections only")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temp dir, removed after)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gate_norm.json"))
    args = ap.parse_args()

    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gate-norm-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        t_write, config = timed(write_checkpoint, folder, args.layers, args.hidden, args.heads, args.kv_heads,
                                  0 if args.no_mlp else args.mlp)
        files = shard_files(folder)
        total_bytes = sum(f.stat().st_size for f in files)
        head_dim = args.hidden // args.heads
        qk_bytes = args.layers * (args.heads + args.kv_heads) * head_dim * args.hidden * 2  # bf16
        rows = []

        def row(name, cache, seconds, nbytes_read):
            rows.append({"step": name, "cache": cache, "seconds": seconds,
                         "GB_per_s_of_qk": qk_bytes / seconds / 1e9,
                         "GB_per_s_of_checkpoint": total_bytes / seconds / 1e9,
                         "bytes_read": nbytes_read})

        for cache in ("cold", "warm"):
            if cache == "cold":
                evict(files)
            sec, n = timed(plain_read, files)
            rows.append({"step": "plain read (all bytes)", "cache": cache, "seconds": sec,
                         "GB_per_s_of_qk": None, "GB_per_s_of_checkpoint": n / sec / 1e9, "bytes_read": n})
            if cache == "cold":
                evict(files)
            sec, _ = timed(qk_read_only, folder, args.layers)
            row("qk read only (safe_open + fp32)", cache, sec, qk_bytes)
            if cache == "cold":
                evict(files)
            sec, scores = timed(gate_norm_scores, folder)
            row("gate-norm (read + grams, overlapped)", cache, sec, qk_bytes)
        q = torch.randn(args.heads * head_dim, args.hidden)
        k = torch.randn(args.kv_heads * head_dim, args.hidden)
        sec, _ = timed(lambda: [gate_norm_qk(q, k, args.heads, args.kv_heads) for _ in range(args.layers)])
        row("grams only (fp32, in memory)", "-", sec, 0)
        result = {
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg()},
            "checkpoint": {**config, "dtype": "bfloat16", "files": len(files), "bytes": total_bytes,
                           "qk_bytes": qk_bytes, "write_s": t_write},
            "rows": rows,
            "gate_norm_first_layers": scores[:4],
            "command": "benchmarks/gate_norm.py " + " ".join(sys.argv[1:]),
        }
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)

    print(f"checkpoint: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, "
          f"{total_bytes / 1e9:.2f} GB in {len(files)} shards (q+k {qk_bytes / 1e9:.2f} GB), "
          f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f}")
    print(f"{'step':<40} {'cache':<6} {'s':>7} {'GB/s q+k':>9} {'GB/s ckpt':>10}")
    for r in rows:
        qk = f"{r['GB_per_s_of_qk']:.2f}" if r["GB_per_s_of_qk"] is not None else "-"
        print(f"{r['step']:<40} {r['cache']:<6} {r['seconds']:>7.2f} {qk:>9} {r['GB_per_s_of_checkpoint']:>10.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
