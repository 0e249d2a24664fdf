"""Benchmark layercut::gptq_matmul on a GPU: Triton, CUDA C and a dense fp16 matmul side by side.

Usage::

    python benchmarks/kernel_speed.py                                  # GPU: Llama-7B and -70B shapes, 4-bit
    python benchmarks/kernel_speed.py --bits 4,3 --out $OUT/kernels.json
    python benchmarks/kernel_speed.py --dry-run                        # any machine: print the plan, time nothing

For every (in, out) projection shape of Llama-7B and Llama-70B, batch 1/4/16 (decode: GEMV,
split-K) and 512 (prefill), and every bits value (group size 128, static groups), it times

* ``triton``: the op with ``LAYERCUT_KERNELS=triton`` (autotuned on the first call);
* ``cuda``: the op with ``LAYERCUT_KERNELS=cuda`` (the CUDA C GEMV up to batch 16, the dequantize
  kernel + cuBLAS above);
* ``fp16``: ``x @ W16.T`` with a dense fp16 weight (cuBLAS), the baseline to beat at decode.

Each call is timed inside a CUDA graph (``--reps`` calls per graph, replayed ``--iters`` times,
CUDA events): at batch 1 a 4096 x 4096 4-bit layer takes about 2 us on an H100-class GPU, far
below the op's Python dispatch cost, which a graph removes (``"graph": false`` in a row means
capture failed and the row was timed eagerly, launch overhead included). Bytes counted: the
weight as stored (qweight + qzeros + scales; fp16 weight for the baseline) plus x and y. GB/s is
those bytes over the time, and ``pct_copy_bw`` that rate over the device-to-device copy bandwidth
measured first (bytes read + written by ``dst.copy_(src)`` on 1 GiB). ``max_rel_err`` compares
each kernel to the pure-torch reference (max |y - ref| / max |ref|).

Goals (issue 14): 4-bit, batch 1, 4096 x 11008: Triton >= 75% of copy bandwidth and within
1.3x of the CUDA C GEMV. Imports only torch (+ triton through the op) so it runs on a bare
GPU machine; writes JSON only when something was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from layercut.compress.kernels import ops  # noqa: E402
from layercut.compress.quant.format.pack import dequantize_gptq, packed_rows  # noqa: E402

# (name, in, out, count per block): the projections of one transformer block
MODELS = {
    "llama-7b": (("qkvo", 4096, 4096, 4), ("gate/up", 4096, 11008, 2), ("down", 11008, 4096, 1)),
    "llama-70b": (
        ("q/o", 8192, 8192, 2),
        ("k/v", 8192, 1024, 2),
        ("gate/up", 8192, 28672, 2),
        ("down", 28672, 8192, 1),
    ),
}
GROUP_SIZE = 128
DEFAULT_OUT = Path(__file__).parent / "results" / "kernels.json"
KERNELS = ("triton", "cuda", "fp16")


def random_layer(in_f: int, out_f: int, bits: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Random GPTQ v1 tensors (static groups of 128): random words are valid codes at any width."""
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = (in_f + GROUP_SIZE - 1) // GROUP_SIZE

    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, device=device, generator=gen)

    qweight = words(packed_rows(in_f, bits), out_f)
    qzeros = words(groups, packed_rows(out_f, bits))
    scales = (torch.rand(groups, out_f, device=device, generator=gen) * 2e-3 + 1e-3).half()
    g_idx = (torch.arange(in_f, device=device) // GROUP_SIZE).int()
    return [qweight, qzeros, scales, g_idx]


def weight_bytes(args: list[torch.Tensor]) -> int:
    """Bytes the kernels read for the weight: qweight + qzeros + scales (static groups: no g_idx)."""
    return sum(t.numel() * t.element_size() for t in args[:3])


def time_call(fn, iters: int, reps: int) -> tuple[float, bool]:
    """Seconds per call of ``fn`` and whether a CUDA graph was used (else eager, events)."""
    for _ in range(3):
        fn()  # compile, autotune, allocate outside the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm the graph's stream
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(reps):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (iters * reps), True
    except Exception as exc:  # a kernel that cannot be captured: time it eagerly, say so
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eagerly)")
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters * reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (iters * reps), False


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t, _ = time_call(lambda: dst.copy_(src), iters=10, reps=2)
    return 2 * nbytes / t / 1e9


def _call(kernel: str, x: torch.Tensor, w16: torch.Tensor, args: list[torch.Tensor], bits: int):
    """A no-argument call of one kernel: fp16 matmul, or the op with LAYERCUT_KERNELS=kernel."""
    if kernel == "fp16":
        return lambda: x @ w16.T

    def call():
        old = os.environ.get("LAYERCUT_KERNELS")
        os.environ["LAYERCUT_KERNELS"] = kernel
        try:
            return torch.ops.layercut.gptq_matmul(x, *args, bits, GROUP_SIZE)
        finally:
            if old is None:
                os.environ.pop("LAYERCUT_KERNELS", None)
            else:
                os.environ["LAYERCUT_KERNELS"] = old

    return call


def bench_gpu(
    models: list[str], bits_list: list[int], batches: list[int], iters: int, reps: int, save
) -> dict:
    """Time every row; ``save(result)`` is called after each layer shape (a timeout keeps those)."""
    dev = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth()
    print(f"device: {dev}; measured D2D copy bandwidth: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rows = []
    result = {"device": dev, "copy_bandwidth_gbps": copy_gbps, "rows": rows, "complete": False}
    for model in models:
        for name, in_f, out_f, _count in MODELS[model]:
            w16 = (torch.randn(out_f, in_f, device="cuda") * 0.02).half()
            for bits in bits_list:
                args = random_layer(in_f, out_f, bits, "cuda")
                w_ref = dequantize_gptq(*args, bits)  # [out, in] fp32, what the reference multiplies by
                for batch in batches:
                    x = torch.randn(batch, in_f, device="cuda").half()
                    ref = x.float() @ w_ref.T  # = ops.reference_gptq_matmul before its cast to fp16
                    io = 2 * batch * (in_f + out_f)
                    for kernel in KERNELS:
                        if kernel == "fp16" and bits != bits_list[0]:
                            continue  # the baseline does not depend on bits
                        fn = _call(kernel, x, w16, args, bits)
                        moved = (w16.numel() * 2 if kernel == "fp16" else weight_bytes(args)) + io
                        try:
                            t, graphed = time_call(fn, iters, reps)
                            err = None
                            if kernel != "fp16":
                                y = fn().float()
                                err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                            ran = ops.last_kernel() if kernel != "fp16" else "cublas_fp16"
                        except Exception as exc:  # one kernel failing must not lose the others
                            print(
                                f"  {model} {name} b{bits} batch {batch} {kernel}: FAILED {exc}", flush=True
                            )
                            rows.append({"model": model, "layer": name, "in": in_f, "out": out_f,
                                         "bits": 16 if kernel == "fp16" else bits, "batch": batch,
                                         "kernel": kernel, "error": str(exc)[:500]})  # fmt: skip
                            continue
                        gbps = moved / t / 1e9
                        rows.append({
                            "model": model, "layer": name, "in": in_f, "out": out_f,
                            "bits": 16 if kernel == "fp16" else bits, "group_size": GROUP_SIZE, "batch": batch, "kernel": kernel, "ran": ran,
                            "graph": graphed, "time_us": t * 1e6, "bytes": moved, "gbps": gbps,
                            "pct_copy_bw": 100 * gbps / copy_gbps, "max_rel_err": err,
                        })  # fmt: skip
                        print(_fmt_row(rows[-1]), flush=True)
                del w_ref
            torch.cuda.empty_cache()
            save({**result, "summary": summarize(rows)})
    return {**result, "complete": True, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    """One block's projections per model, bits (16 = the fp16 baseline), batch and kernel; the goals."""
    by = {(r["model"], r["layer"], r["bits"], r["batch"], r["kernel"]): r for r in rows if "time_us" in r}
    blocks = []
    for model, bits, batch, kernel in sorted({(k[0], k[2], k[3], k[4]) for k in by}):
        found = [by.get((model, name, bits, batch, kernel)) for name, *_ in MODELS[model]]
        if all(found):
            total = sum(r["time_us"] * count for r, (*_, count) in zip(found, MODELS[model]))
            blocks.append({"model": model, "bits": bits, "batch": batch, "kernel": kernel, "block_us": total})
    goal = {}
    tri = by.get(("llama-7b", "gate/up", 4, 1, "triton"))
    cud = by.get(("llama-7b", "gate/up", 4, 1, "cuda"))
    if tri:
        goal["triton_pct_copy_bw_4bit_b1_4096x11008"] = tri["pct_copy_bw"]
        goal["meets_75pct"] = tri["pct_copy_bw"] >= 75
    if tri and cud:
        goal["triton_over_cuda_time"] = tri["time_us"] / cud["time_us"]
        goal["within_1.3x_of_cuda"] = tri["time_us"] <= 1.3 * cud["time_us"]
    return {"blocks": blocks, "goal": goal}


def _fmt_row(r: dict) -> str:
    err = "-" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.1e}"
    return (
        f"{r['model']:<9} {r['layer']:<7} {r['in']:>5}x{r['out']:<5} b={r['bits']} batch={r['batch']:<3} "
        f"{r['kernel']:<6} ({r['ran']:<19}) {r['time_us']:9.1f} us {r['gbps']:7.0f} GB/s "
        f"{r['pct_copy_bw']:5.1f}% copy-bw  err {err}{'' if r['graph'] else '  (eager)'}"
    )


def plan(models: list[str], bits_list: list[int], batches: list[int]) -> list[dict]:
    """The rows a GPU run would time (shapes and bytes), for --dry-run."""
    out = []
    for model in models:
        for name, in_f, out_f, count in MODELS[model]:
            for bits in bits_list:
                groups = (in_f + GROUP_SIZE - 1) // GROUP_SIZE
                wbytes = packed_rows(in_f, bits) * out_f * 4 + groups * packed_rows(out_f, bits) * 4
                wbytes += groups * out_f * 2
                for batch in batches:
                    out.append({"model": model, "layer": name, "in": in_f, "out": out_f, "count": count,
                                "bits": bits, "batch": batch, "quant_bytes": wbytes + 2 * batch * (in_f + out_f),
                                "fp16_bytes": 2 * in_f * out_f + 2 * batch * (in_f + out_f)})  # fmt: skip
    return out


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--models", default="llama-7b,llama-70b", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--bits", type=_ints, default=[4], help="comma list of 2,3,4,8 (default 4)")
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16, 512])
    parser.add_argument("--iters", type=int, default=20, help="graph replays per row")
    parser.add_argument("--reps", type=int, default=10, help="calls captured per graph")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS] + [f"bits {b}" for b in args.bits if b not in (2, 3, 4, 8)]
    bad += [f"batch {b}" for b in args.batches if b < 1] + [f"--iters/--reps {args.iters}/{args.reps}"] * (
        min(args.iters, args.reps) < 1
    )
    if bad:
        print(f"error: unknown or invalid: {', '.join(bad)}", file=sys.stderr)
        return 2
    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("no CUDA device: nothing measured, nothing written (the plan follows)")
        rows = plan(models, args.bits, args.batches)
        for r in rows:
            print(f"{r['model']:<9} {r['layer']:<7} {r['in']:>5}x{r['out']:<5} x{r['count']} b={r['bits']} "
                  f"batch={r['batch']:<3} quant {r['quant_bytes'] / 1e6:8.2f} MB  fp16 {r['fp16_bytes'] / 1e6:8.2f} MB")  # fmt: skip
        print(f"{len(rows)} shapes x {len(KERNELS)} kernels")
        return 0
    start = time.time()
    meta = dict(
        torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        triton=_triton_version(),
        command="python benchmarks/kernel_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )  # fmt: skip

    def save(result: dict) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**result, **meta, "seconds": time.time() - start}, indent=2) + "\n")
        tmp.replace(args.out)  # atomic: a reader never sees half a file

    result = bench_gpu(models, args.bits, args.batches, args.iters, args.reps, save)
    save(result)
    for b in result["summary"]["blocks"]:
        print(
            f"block {b['model']:<9} b={b['bits']} batch={b['batch']:<3} {b['kernel']:<6} {b['block_us']:8.1f} us"
        )
    print("goal:", json.dumps(result["summary"]["goal"]))
    print(f"wrote {args.out}")
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
