"""Benchmark layercut::gptq_matmul against a dense fp16 matmul.

Usage::

    python benchmarks/kernels.py                       # GPU: Llama-7B shapes; CPU: a small reference run
    python benchmarks/kernels.py --out $OUT/kernels.json --iters 200

For each (in, out) in {4096x4096, 4096x11008, 11008x4096}, batch in {1, 4, 16} and bits in
{2, 3, 4, 8} (group size 128, static groups) it reports: time per call, effective GB/s
(bytes of qweight + qzeros + scales + x + y divided by the time), that rate as a fraction of
the device-to-device copy bandwidth measured here, the speedup over ``x @ W16.T`` with W16 the
fp16 weight, and the max error against the pure-torch reference. Batch-1 decode is
memory-bound, so the fraction of copy bandwidth is the number to watch.

Without CUDA it times the reference path at a small size and says so: GPU numbers are then
unmeasured, and none are written.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from compress.kernels import ops  # noqa: E402
from compress.quant.pack import pack_gptq  # noqa: E402

SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))  # (in, out) of Llama-7B projections
BATCHES = (1, 4, 16)
BITS = (2, 3, 4, 8)
GROUP_SIZE = 128
DEFAULT_OUT = Path(__file__).parent / "results" / "kernels.json"


def random_layer(in_f: int, out_f: int, bits: int, gs: int, device: str, act_order: bool = False):
    """Random GPTQ v1 tensors of one layer (packed on ``device``) and the op's group_size."""
    gen = torch.Generator(device=device).manual_seed(in_f * 7 + out_f + bits)
    groups = (in_f + gs - 1) // gs
    g_idx = torch.arange(in_f, device=device) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, device=device, generator=gen)]
    maxq = (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (out_f, in_f), device=device, generator=gen)
    z = torch.randint(1, maxq + 1, (groups, out_f), device=device, generator=gen)
    s = torch.rand(groups, out_f, device=device, generator=gen) * 0.01 + 1e-3
    packed = pack_gptq(q, z, s, g_idx, bits)
    return packed, (ops.ACT_ORDER if act_order else gs)


def packed_bytes(packed: dict[str, torch.Tensor], act_order: bool) -> int:
    """Bytes the kernel reads for the weight: qweight + qzeros + scales (+ g_idx under act-order)."""
    names = ("qweight", "qzeros", "scales") + (("g_idx",) if act_order else ())
    return sum(packed[k].numel() * packed[k].element_size() for k in names)


def cuda_time(fn, iters: int, warmup: int = 10) -> float:
    """Mean seconds per call of ``fn`` on the current stream (CUDA events, launches included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters, warmup=3)
    return 2 * nbytes / t / 1e9


def bench_gpu(iters: int, act_order: bool) -> dict:
    dev = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth()
    print(f"device: {dev}; measured D2D copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    rows = []
    for in_f, out_f in SHAPES:
        w16 = torch.randn(out_f, in_f, device="cuda", dtype=torch.float16) * 0.02
        for bits in BITS:
            packed, op_gs = random_layer(in_f, out_f, bits, GROUP_SIZE, "cuda", act_order)
            args = [packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")]
            wbytes = packed_bytes(packed, act_order)
            for batch in BATCHES:
                x = torch.randn(batch, in_f, device="cuda", dtype=torch.float16)
                kernel = ops.select_kernel(bits, op_gs, "cuda", batch, in_f, out_f, x.dtype).name
                t_q = cuda_time(partial(torch.ops.layercut.gptq_matmul, x, *args, bits, op_gs), iters)
                t_fp16 = cuda_time(partial(torch.matmul, x, w16.T), iters)
                y = torch.ops.layercut.gptq_matmul(x, *args, bits, op_gs).float()
                ref = ops.reference_gptq_matmul(x, *args, bits).float()
                err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                moved = wbytes + 2 * batch * (in_f + out_f)
                gbps = moved / t_q / 1e9
                rows.append({
                    "in": in_f, "out": out_f, "bits": bits, "batch": batch, "group_size": GROUP_SIZE,
                    "act_order": act_order, "kernel": kernel, "time_us": t_q * 1e6,
                    "bytes": moved, "gbps": gbps, "pct_copy_bw": 100 * gbps / copy_gbps,
                    "fp16_time_us": t_fp16 * 1e6, "speedup_vs_fp16": t_fp16 / t_q, "max_rel_err": err,
                })  # fmt: skip
                print(_fmt_row(rows[-1]), flush=True)
    return {"device": dev, "copy_bandwidth_gbps": copy_gbps, "gpu_measured": True, "rows": rows}


def bench_cpu(iters: int) -> dict:
    """The reference path at a small size: only shows the script works; no GPU numbers."""
    print("no CUDA device: GPU numbers are UNMEASURED. Timing the pure-torch reference at 512x512 on CPU.")
    rows = []
    for bits in BITS:
        packed, op_gs = random_layer(512, 512, bits, GROUP_SIZE, "cpu")
        args = [packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")]
        w32 = torch.randn(512, 512)
        for batch in (1, 4):
            x = torch.randn(batch, 512)
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.ops.layercut.gptq_matmul(x, *args, bits, op_gs)
            t_q = (time.perf_counter() - t0) / iters
            t0 = time.perf_counter()
            for _ in range(iters):
                x @ w32.T
            t_dense = (time.perf_counter() - t0) / iters
            moved = packed_bytes(packed, False) + 4 * batch * 1024
            rows.append({
                "in": 512, "out": 512, "bits": bits, "batch": batch, "group_size": GROUP_SIZE,
                "act_order": False, "kernel": "reference", "time_us": t_q * 1e6, "bytes": moved,
                "gbps": moved / t_q / 1e9, "pct_copy_bw": None, "fp16_time_us": None,
                "dense_fp32_time_us": t_dense * 1e6, "speedup_vs_fp16": None, "max_rel_err": 0.0,
            })  # fmt: skip
            print(_fmt_row(rows[-1]), flush=True)
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "copy_bandwidth_gbps": None,
        "gpu_measured": False,
        "note": "no CUDA device: GPU kernel numbers unmeasured",
        "rows": rows,
    }


def _fmt_row(r: dict) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    return (
        f"{r['in']:>6}x{r['out']:<6} b={r['bits']} batch={r['batch']:<3} {r['kernel']:<20} "
        f"{r['time_us']:9.1f} us {r['gbps']:8.1f} GB/s {f(r['pct_copy_bw'], '5.1f'):>5}% copy-bw "
        f"x{f(r['speedup_vs_fp16'], '5.2f')} vs fp16  err {r['max_rel_err']:.1e}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--act-order", action="store_true", help="random act-order g_idx (slower path)")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        result = bench_gpu(args.iters, args.act_order)
    else:
        result = bench_cpu(min(args.iters, 20))
    result.update(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
