"""Compare layercut's GPTQ core with GPTQModel 7.6's on one layer: same W, same H.

Run (CPU is fine, a few minutes with one thread; needs the `gptq` extra)::

    OMP_NUM_THREADS=1 GPTQMODEL_CPU_WORKERS=2 python benchmarks/gptq_core_vs_gptqmodel.py [--out 1024 --in 2048]

Prints a table and writes ``benchmarks/results/gptq_core_vs_gptqmodel.json`` (``--json-out``).

For each setting both implementations quantize the same weight with the same Hessian
H = 2/N Σ x xᵀ (x: correlated, heavy-tailed synthetic activations). Reported per row:

- ``loss``: the GPTQ objective Σ err²/(2 d²) (GPTQModel's ``avg_loss`` × N, since it
  divides by the token count) — it includes the damping term;
- ``out_err``: ½ tr(ΔW H ΔWᵀ) = mean over tokens of ‖(W - Ŵ) x‖², undamped, computed
  the same way for both results; RTN's is given as the baseline;
- ``gm fp16``: GPTQModel's out_err once its scales are stored as float16 (as packing
  does; layercut rounds its scales to float16 before quantizing, so its result is
  already what a checkpoint decodes to);
- ``rel``: layercut out_err / GPTQModel out_err (fp32 scales);
- ``damp used``: GPTQModel's damping after its automatic increments (it raises the damping
  when the Cholesky factorization fails; layercut does not), so a row where it differs from
  ``--damp`` is not at matched damping.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from layercut.compress.quant.solve.gptq import gptq_quantize, hessian_update, layer_loss, rtn_quantize  # noqa: E402

SETTINGS = [  # bits, group_size, sym, act_order, static_groups
    (4, 128, False, False, False),
    (4, 128, True, False, False),
    (4, 32, False, False, False),
    (3, 128, False, False, False),
    (3, -1, False, False, False),
    (4, 128, False, True, False),
    (4, 128, True, True, True),
    (2, 64, False, False, False),
    (8, 128, True, False, False),
    (3, 128, False, False, True),
]


def make_layer(out_f: int, in_f: int, n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A weight [out, in] and the Hessian [in, in] of correlated, outlier-heavy inputs."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_f, in_f, generator=g) / in_f**0.5
    chan_scale = torch.exp(torch.randn(in_f, generator=g))  # a few large channels, as in LLMs
    x = (torch.randn(n_tokens, in_f, generator=g) @ mix + 0.5 * torch.randn(n_tokens, in_f, generator=g)) * chan_scale
    W = torch.randn(out_f, in_f, generator=g) * 0.02
    H, n = hessian_update(None, 0, x)
    return W, H, n


def gptqmodel_quantize(W, H, n, bits, gs, sym, act_order, static_groups, damp):
    """Run GPTQModel's GPTQ.quantize on an nn.Linear holding W, with H injected."""
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ

    lin = nn.Linear(W.shape[1], W.shape[0], bias=False)
    lin.weight.data = W.clone()
    qcfg = QuantizeConfig(
        bits=bits, group_size=gs, sym=sym, desc_act=act_order, static_groups=static_groups,
        damp_percent=damp, damp_auto_increment=0.0015, mse=0.0, fallback=None,
        act_group_aware=False,  # GPTQModel's default group-aware reordering is not plain GPTQ
    )
    task = GPTQ(lin, qcfg)
    task.quantizer.configure(perchannel=True)
    task.H = H.to(torch.float32).clone()
    task.nsamples = n
    task._hessian_dirty = False
    Q, scale, zero, g_idx, _dur, avg_loss, damp_used, _ns = task.quantize(blocksize=128)
    Q = Q.float()
    # what a GPTQ v1 checkpoint would hold: the same codes with float16 scales
    gi = g_idx.long()
    s, z = scale[:, gi].float(), zero[:, gi].float()  # [out, in]
    q = torch.clamp(torch.round(Q / s) + z, 0, 2**bits - 1)
    shipped = s.half().float() * (q - z)
    return Q, shipped, float(avg_loss) * n, damp_used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=int, default=512)
    ap.add_argument("--in", dest="in_f", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/gptq_core_vs_gptqmodel.json"))
    args = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

    W, H, n = make_layer(args.out, args.in_f, args.tokens, args.seed)
    print(f"layer W [{args.out}, {args.in_f}], N = {n} tokens, damp = {args.damp}, torch {torch.__version__}")
    hdr = ("bits   gs   sym   act  stat |  loss lc   loss gm | out_err lc  out_err gm   gm fp16   rel  |   rtn  | "
           "t lc  t gm | damp used")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for bits, gs, sym, ao, st in SETTINGS:
        t0 = time.perf_counter()
        r = gptq_quantize(W, H, bits, gs, sym=sym, act_order=ao, static_groups=st, damp=args.damp)
        t1 = time.perf_counter()
        Qg, Qg16, loss_g, damp_used = gptqmodel_quantize(W, H, n, bits, gs, sym, ao, st, args.damp)
        t2 = time.perf_counter()
        err_l = layer_loss(W, r.dequant, H)
        err_g = layer_loss(W, Qg, H)
        err_r = layer_loss(W, rtn_quantize(W, bits, gs, sym).dequant, H)
        err_g16 = layer_loss(W, Qg16, H)
        print(
            f"{bits:>4} {gs:>4} {sym!s:>5} {ao!s:>5} {st!s:>5} | {r.loss:9.4g} {loss_g:9.4g} | "
            f"{err_l:10.4g} {err_g:11.4g} {err_g16:9.4g} {err_l / err_g:6.3f} | {err_r:6.4g} | "
            f"{t1 - t0:4.1f}s {t2 - t1:4.1f}s | {float(damp_used):g}"
        )
        rows.append({"bits": bits, "group_size": gs, "sym": sym, "act_order": ao, "static_groups": st,
                     "loss_layercut": r.loss, "loss_gptqmodel": loss_g, "out_err_layercut": err_l,
                     "out_err_gptqmodel": err_g, "out_err_gptqmodel_fp16_scales": err_g16, "rel": err_l / err_g,
                     "out_err_rtn": err_r, "seconds_layercut": t1 - t0, "seconds_gptqmodel": t2 - t1,
                     "damp_used_gptqmodel": float(damp_used)})
    import gptqmodel

    result = {
        "layer": {"out": args.out, "in": args.in_f, "tokens": n, "seed": args.seed},
        "damp": args.damp, "torch": torch.__version__, "gptqmodel": gptqmodel.__version__,
        "threads": torch.get_num_threads(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rows": rows,
        "command": "OMP_NUM_THREADS=1 GPTQMODEL_CPU_WORKERS=2 python benchmarks/gptq_core_vs_gptqmodel.py "
                   + " ".join(sys.argv[1:]),
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(out, result)
    rel = [row["rel"] for row in rows]
    print(f"layercut / GPTQModel out_err: {min(rel):.3f}–{max(rel):.3f} over {len(rows)} settings; wrote {out}")


if __name__ == "__main__":
    main()
