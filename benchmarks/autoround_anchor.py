"""AutoRound (Intel ``auto-round``) as an outside anchor for layercut's block-wise reconstruction.

Run (from the repository root; AutoRound lives in its own venv so layercut's stays untouched)::

    python3 -m venv .venv-autoround
    .venv-autoround/bin/pip install torch==2.13.0 auto-round==0.16.1    # the CPU torch wheel
    # smoke run (2 iters), then the default recipe (200 iters); --ar-python PATH for another venv
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/autoround_anchor.py --configs smoke
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/autoround_anchor.py --configs default
    .venv/bin/python benchmarks/autoround_anchor.py --from-json benchmarks/results/autoround_anchor-brown-val.json
    # gemma-3-270m (its GGUF, see benchmarks/block_tune.py), 3-bit g128, on the test split
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/autoround_anchor.py \
        --model ~/.cache/layercut-dev/gemma-3-270m-q4_k_m.gguf --group-size 128 --text bundled:brown-test \
        --json-out benchmarks/results/autoround_anchor-brown-test.json

What it does, per config (``NAME`` = ``ITERS[@LR][xNSAMPLES]``, or a preset in ``PRESETS``):

1. In this (layercut) venv: dump layercut's calibration token ids,
   ``calibration_batch(tok, "bundled:brown-calib", samples=64, seq_len=128, seed=SEED)`` (the
   block_tune benchmark's 64 x 128), to a ``.pt`` file, and resolve ``bundled:smollm2-135m`` to its
   float32 HF folder (``resolve_model``: the GGUF converted once under ``$LAYERCUT_CACHE/models``);
   ``--model`` names another (a ``.gguf``: rows ``gemma3/...`` when its name says gemma).
2. In ``--ar-python`` (the AutoRound venv): this same file with ``--worker`` builds
   ``AutoRound(model_dir, scheme=W3A16-like dict(bits, group_size, sym), dataset=[{"input_ids",
   "attention_mask"}, ...], nsamples, seqlen, iters, lr, batch_size, device_map="cpu")`` and calls
   ``quantize_and_save(out, format="auto_gptq")`` (it writes ``out/<model>-w<bits>g<group>/``). The
   dataset is the SAME token ids, one dict per sequence (no re-tokenisation; attention mask all ones,
   as layercut's batch has no padding; AutoRound still masks each row's last position and marks the
   4 EOS separators, = its pad id, as ignored in its cached ids).
3. ``layercut eval OUT --reference bundled:smollm2-135m --text TEXT --max-tokens 4096 --ctx 512``
   in this venv, so KL/ppl are comparable with the block_tune rows.

Each child's wall time, CPU time and peak RSS are measured with ``wait4``. Cost on one core (auto-round
0.16.1, torch 2.13.0+cpu, torch.compile on, which AutoRound enables by itself at >= 10 iters): ~70-80
CPU-s per block at 200 iters, so ~40 CPU-min for the default recipe and ~5x that for 1000 iters;
``smoke`` (2 iters) takes ~2 min. A row whose eval failed is re-evaluated from the kept checkpoint
(``--workdir``) on the next run instead of being re-quantized. Rows go to
``benchmarks/results/autoround_anchor-brown-val.json`` (merged; rows not rerun are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AR_PYTHON = str(ROOT / ".venv-autoround" / "bin" / "python")
MODEL = "bundled:smollm2-135m"
CALIB = "bundled:brown-calib"
# iters / lr (None: AutoRound's default, 1/iters) / nsamples; AutoRound's own CLI recipes (auto_round/cli/main.py
# RECIPES) are default = 200 iters, 128 x 2048, lr None; best = 1000 iters, 512 x 2048; light = 50 iters, lr 5e-3.
# Here nsamples x seqlen is always layercut's 64 x 128 unless a config says otherwise.
PRESETS: dict[str, dict] = {
    "smoke": {"iters": 2, "lr": None, "nsamples": 64},
    "default": {"iters": 200, "lr": None, "nsamples": 64},
    "light": {"iters": 50, "lr": 5e-3, "nsamples": 64},
    "best": {"iters": 1000, "lr": None, "nsamples": 64},
}
BASELINES = {  # layercut rows on the same setup (benchmarks/results/block_tune-brown-val.json, seed 0)
    "layercut GPTQ 3-bit g64": "smollm2/3/none/seed0",
    "layercut GPTQ+block-tune 3-bit (default)": "smollm2/3/100x4@0.003~channel/seed0",
    "layercut GPTQ+block-tune 3-bit mse": "smollm2/3/100x4@0.003/seed0",
    "layercut GPTQ+block-tune 3-bit 200 steps": "smollm2/3/200x4@0.003~channel/seed0",
    "layercut GPTQ 4-bit g64": "smollm2/4/none/seed0",
}


def parse_config(name: str) -> dict:
    """A preset name, or ``ITERS[@LR][xNSAMPLES]`` (e.g. ``400@0.005x64``)."""
    if name in PRESETS:
        return dict(PRESETS[name])
    body, _, ns = name.partition("x")
    iters, _, lr = body.partition("@")
    return {"iters": int(iters), "lr": float(lr) if lr else None, "nsamples": int(ns) if ns else 64}


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, dict]:
    """Run ``cmd`` with stdout+stderr to ``log``; return its exit code and {wall_s, cpu_s, peak_rss_mb}."""
    t = time.perf_counter()
    with open(log, "w") as fh:
        pid = os.posix_spawn(cmd[0], cmd, env, file_actions=[(os.POSIX_SPAWN_DUP2, fh.fileno(), 1),
                                                            (os.POSIX_SPAWN_DUP2, fh.fileno(), 2)])
        _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), {"wall_s": round(time.perf_counter() - t, 1),
                                               "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                                               "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def _checkpoint(q: Path) -> Path | None:
    """The folder AutoRound wrote under ``q`` (it adds ``<model>-w<bits>g<group>/``), or None."""
    found = sorted(p.parent for p in q.rglob("config.json")) if q.is_dir() else []
    return found[0] if found else None


def _auto_lr(iters: int, bits: int) -> float:
    """AutoRound 0.16.1's lr when none is given (SignRoundConfig._lr_for_bits): 1/iters, 2/iters at
    >= 1000 iters and <= 3 bits; its min-max lr defaults to the same."""
    return 2.0 / iters if iters >= 1000 and bits <= 3 else 1.0 / iters


def dump_calibration(path: Path, samples: int, seq_len: int, seed: int, model: str = MODEL) -> str:
    """Write layercut's calibration ids to ``path``; return the float HF folder of ``model``."""
    import torch

    from layercut.calibrate.data import calibration_batch
    from layercut.compress.io.models import load_tokenizer, resolve_model

    tok = load_tokenizer(model)
    calib = calibration_batch(tok, CALIB, samples=samples, seq_len=seq_len, seed=seed)
    torch.save({"input_ids": calib.input_ids, "attention_mask": calib.attention_mask}, path)
    return str(resolve_model(model))


def worker(args: argparse.Namespace) -> None:
    """Runs in the AutoRound venv: quantize ``args.model_dir`` on the dumped ids, save as GPTQ."""
    import auto_round
    import torch
    import transformers
    from auto_round import AutoRound

    data = torch.load(args.calib)
    ids, mask = data["input_ids"][: args.nsamples], data["attention_mask"][: args.nsamples]
    dataset = [{"input_ids": ids[i: i + 1].clone(), "attention_mask": mask[i: i + 1].clone()}
               for i in range(ids.shape[0])]
    scheme = {"bits": args.bits, "group_size": args.group_size, "sym": args.sym, "data_type": "int"}
    kwargs = {"lr": args.lr} if args.lr is not None else {}
    t = time.perf_counter()
    ar = AutoRound(args.model_dir, scheme=scheme, dataset=dataset, iters=args.iters, nsamples=len(dataset),
                   seqlen=ids.shape[1], batch_size=args.batch_size, seed=args.seed, device_map="cpu", **kwargs)
    ar.quantize_and_save(args.out, format="auto_gptq")
    info = {"auto_round": auto_round.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "quantize_and_save_s": round(time.perf_counter() - t, 1)}
    print("AR_WORKER_JSON " + json.dumps(info), flush=True)


def run(args: argparse.Namespace) -> dict:
    from _results import write_merged

    out = Path(args.json_out)
    stored = json.loads(out.read_text()) if out.is_file() else {}
    rows: dict = stored.get("runs", {})
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    sym = "sym" if args.sym else "asym"
    setup = {"model": args.model, "text": args.text, "calib": f"{args.samples} x {args.seq_len} {CALIB} seed {args.seed} "
             "(layercut's ids, fed to AutoRound as tensors)", "eval": "4096 tokens, ctx 512, KL to the original",
             "bits": args.bits, "group_size": args.group_size, "sym": args.sym, "format": "auto_gptq",
             "batch_size": args.batch_size, "threads": os.environ.get("OMP_NUM_THREADS", "default"),
             "cpus": os.cpu_count(), **({"note": args.note} if args.note else {})}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ar-anchor-"))
    work.mkdir(parents=True, exist_ok=True)
    calib = work / f"calib-{args.samples}x{args.seq_len}-seed{args.seed}.pt"
    from layercut.compress.core.errors import LayercutError

    try:
        model_dir = dump_calibration(calib, args.samples, args.seq_len, args.seed, args.model)
    except LayercutError as e:  # a wrong --model: one line, before anything is written
        raise SystemExit(f"autoround_anchor: {e}") from None
    mname = "gemma3" if "gemma" in args.model.lower() else "smollm2"
    for c in [c for c in args.configs.split(",") if c]:
        cfg = parse_config(c)
        key = f"{mname}/{args.bits}/g{args.group_size}/{sym}/{c}/seed{args.seed}"
        row = rows.get(key, {})
        if "kl" in row and not args.rerun:
            continue
        q = work / f"q-{c.replace('@', '_')}"
        ckpt = _checkpoint(q)
        if ckpt is not None and "autoround" in row and not args.rerun:  # quantized before, its eval failed: eval only
            cost, info = row["autoround"], row["versions"]
        else:
            cmd = [args.ar_python, str(Path(__file__).resolve()), "--worker", "--model-dir", model_dir, "--calib",
                   str(calib), "--out", str(q), "--bits", str(args.bits), "--group-size", str(args.group_size),
                   "--iters", str(cfg["iters"]), "--nsamples", str(cfg["nsamples"]), "--batch-size",
                   str(args.batch_size), "--seed", str(args.seed)] + (["--sym"] if args.sym else [])
            cmd += ["--lr", str(cfg["lr"])] if cfg["lr"] is not None else []
            rc, cost = _spawn(cmd, env, work / f"{q.name}.log")
            if rc != 0:
                tail = (work / f"{q.name}.log").read_text()[-3000:]
                raise SystemExit(f"AutoRound {c} failed (rc {rc}), log {work / f'{q.name}.log'}:\n{tail}")
            log = (work / f"{q.name}.log").read_text()
            info = json.loads(next(ln for ln in log.splitlines() if ln.startswith("AR_WORKER_JSON "))[15:])
            ckpt = _checkpoint(q)
            if ckpt is None:
                raise SystemExit(f"AutoRound {c}: no config.json under {q}")
        log_path = work / f"{q.name}.log"
        if log_path.is_file():
            info["torch_compile"] = "`torch.compile` is enabled" in log_path.read_text()
        cfg["lr_used"] = cfg["lr"] if cfg["lr"] is not None else _auto_lr(cfg["iters"], args.bits)
        info["quantization_config"] = json.loads((ckpt / "config.json").read_text()).get("quantization_config")
        ev_cmd = [sys.executable, "-m", "layercut.cli", "-q", "eval", str(ckpt), "--reference", args.model, "--text",
                  args.text, "--max-tokens", "4096", "--ctx", "512", "--json"]
        erc, ecost = _spawn(ev_cmd, env, work / f"{q.name}.eval.log")
        elog = (work / f"{q.name}.eval.log").read_text()
        if erc != 0:
            rows[key] = {"config": cfg, "autoround": cost, "versions": info, "eval_error": elog[-2000:]}
            print(f"{key}: layercut eval failed (rc {erc}):\n{elog[-2000:]}", flush=True)
        else:
            ev = json.loads(next(ln for ln in reversed(elog.splitlines()) if ln.startswith("{")))
            rows[key] = {"kl": ev["kl"], "ppl": ev["ppl"], "reference_ppl": ev["reference_ppl"], "bytes": ev["bytes"],
                         "config": cfg, "autoround": cost, "eval": ecost, "versions": info}
            print(f"{key}: KL {ev['kl']:.4f} ppl {ev['ppl']:.2f} autoround {cost}", flush=True)
        write_merged(out, {"setup": setup, "runs": rows})
    return write_merged(out, {"setup": setup, "runs": rows})


def table(data: dict) -> str:
    lines = [f"{'row':<44} {'KL':>7} {'ppl':>7} {'wall s':>8} {'CPU s':>8} {'RSS MB':>7}"]
    base = ROOT / "benchmarks" / "results" / "block_tune-brown-val.json"
    if base.is_file() and data.get("setup", {}).get("text") == "bundled:brown-val":
        b = json.loads(base.read_text())["runs"]
        for label, k in BASELINES.items():
            if k in b:
                r = b[k]
                lines.append(f"{label:<44} {r['kl']:>7.4f} {r['ppl']:>7.2f} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
                             f"{r['peak_rss_mb']:>7}")
    for k, r in data.get("runs", {}).items():
        c = r["autoround"]
        if "kl" in r:
            lines.append(f"AR {k:<41} {r['kl']:>7.4f} {r['ppl']:>7.2f} {c['wall_s']:>8.1f} {c['cpu_s']:>8.1f} "
                         f"{c['peak_rss_mb']:>7}")
        else:
            lines.append(f"AR {k:<41} {'eval failed':>15} {c['wall_s']:>8.1f} {c['cpu_s']:>8.1f} {c['peak_rss_mb']:>7}")
    lines.append("wall/CPU/RSS: the quantizing child alone (AutoRound: quantize + GPTQ export; layercut rows: "
                 "`layercut quantize`)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="internal: run AutoRound (in the AutoRound venv)")
    ap.add_argument("--model", default=MODEL, help="bundled:NAME or a .gguf (gemma-3-270m: rows named gemma3/...)")
    ap.add_argument("--model-dir")
    ap.add_argument("--calib")
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--configs", default="default", help="comma-separated presets or ITERS[@LR][xNSAMPLES]")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sym", action="store_true", help="symmetric (default: asymmetric, as layercut's default)")
    ap.add_argument("--batch-size", type=int, default=8, help="AutoRound's tuning batch (its default 8)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default="bundled:brown-val")
    ap.add_argument("--ar-python", default=AR_PYTHON)
    ap.add_argument("--workdir", default=None, help="where the ids, checkpoints and logs go (default: a temp dir)")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--note", default=None, help="stored in the JSON's setup (e.g. what else loaded the machine)")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "autoround_anchor-brown-val.json"))
    ap.add_argument("--from-json", default=None, help="print the table of a stored JSON and exit")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())))
        return
    print(table(run(args)))


if __name__ == "__main__":
    main()
