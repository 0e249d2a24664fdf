"""Block-wise reconstruction (``layercut quantize --block-tune``) against plain GPTQ at the same bytes.

Run::

    # the choice, on validation (both models, one seed)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/block_tune.py --text bundled:brown-val --seeds 0 \\
        --bits 3 --configs 100@0.01,100@0.05,100@0.05:float
    # the report, on test: plain GPTQ and the default tuning, 3 seeds, both widths, both models
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/block_tune.py --seeds 0,1,2 --bits 3,4
    .venv/bin/python benchmarks/block_tune.py --from-json benchmarks/results/block_tune.json

Models: the bundled SmolLM2-135M (group size 64) and gemma-3-270m (group size 128), read from the
GGUF that ``bash ../shared/models/gemma3-270m.sh`` assembles (``--gemma PATH``; the default is that
script's output path; a missing file skips the model with a line saying so). Per model, width and
calibration seed: ``layercut quantize MODEL --bits B`` (64 x 128 calibration tokens of
bundled:brown-calib, the demo's) without and with each tuning config ``STEPS[xBATCH]@LR[/SCALE_LR[/NORM_LR]][:TARGET][~LOSS]``,
then ``layercut eval`` of each on ``--text`` (4,096 tokens, ctx 512, KL to the original model). Every
command is one child process; its wall time, CPU time and peak RSS are measured here (``wait4``).
Rows go to ``benchmarks/results/block_tune[-SPLIT].json`` (merged: rows not rerun are kept).

The table gives, per config, the KL mean (min–max over seeds), for 3 bits the share of the
(3-bit GPTQ → 4-bit GPTQ) KL gap closed, per seed against the same seed's plain runs, and for
4 bits the change against plain 4-bit GPTQ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_merged  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEMMA = Path.home() / ".cache" / "layercut-dev" / "gemma-3-270m-q4_k_m.gguf"
GROUP_SIZE = {"smollm2": 64, "gemma3": 128}
DEFAULT_CONFIGS = "100x4@0.003~channel"


def _run_child(args: list[str]) -> tuple[dict, dict]:
    """Run ``layercut ARGS --json``; return its report and {wall_s, cpu_s, peak_rss_mb} of that child alone."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "layercut.cli", "-q", *args, "--json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.posix_spawn(sys.executable, cmd, {**os.environ, "HF_HUB_OFFLINE": "1"},
                             file_actions=[(os.POSIX_SPAWN_DUP2, out.fileno(), 1),
                                           (os.POSIX_SPAWN_DUP2, err.fileno(), 2)])
        _, status, usage = os.wait4(pid, 0)
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"layercut {' '.join(args)} failed:\n{err.read()[-3000:]}")
        report = json.loads(out.read().strip().splitlines()[-1])
    return report, {"wall_s": round(time.perf_counter() - t, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                    "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def parse_config(c: str) -> list[str]:
    """``100x4@0.01/0.002/0.001:float~channel`` (steps x batch @ lr / scale lr / norm lr : target ~ loss) -> the
    quantize flags;
    ``none`` -> [] (plain GPTQ). Left out: the CLI default, except the loss: mse."""
    if c == "none":
        return []
    c, _, loss = c.partition("~")
    c, _, target = c.partition(":")
    sb, _, lrs = c.partition("@")
    steps, _, batch = sb.partition("x")
    lr, _, slr = lrs.partition("/")
    slr, _, nlr = slr.partition("/")
    flags = ["--block-tune", "--block-tune-steps", steps] + (["--block-tune-batch", batch] if batch else [])
    flags += ["--block-tune-lr", lr] if lr else []
    flags += ["--block-tune-scale-lr", slr] if slr else []
    flags += ["--block-tune-norm-lr", nlr] if nlr else []
    flags += ["--block-tune-target", target] if target else []
    flags += ["--block-tune-loss", loss or "mse"]  # no ~LOSS: mse, as the rows stored before channel became the default
    return flags


def models(args) -> dict[str, str]:
    out = {}
    for name in args.models.split(","):
        if name == "smollm2":
            out[name] = "bundled:smollm2-135m"
        elif name == "gemma3":
            if Path(args.gemma).is_file():
                out[name] = str(args.gemma)
            else:
                print(f"gemma3: {args.gemma} not found (bash ../shared/models/gemma3-270m.sh); skipped", flush=True)
        else:
            raise SystemExit(f"unknown model {name!r} (smollm2, gemma3)")
    return out


def run(args) -> dict:
    out = Path(args.json_out)
    stored = json.loads(out.read_text()) if out.is_file() else {}
    rows: dict = stored.get("runs", {})
    setup = {"text": args.text, "calib": f"{args.samples} x {args.seq_len} bundled:brown-calib",
             "eval": "4096 tokens, ctx 512, KL to the original", "group_size": GROUP_SIZE,
             "threads": os.environ.get("OMP_NUM_THREADS", "CLI default")}
    configs = ["none"] + [c for c in args.configs.split(",") if c and c != "none"]
    with tempfile.TemporaryDirectory(prefix="block-tune-") as tmp:
        for mname, model in models(args).items():
            for bits in [int(b) for b in args.bits.split(",")]:
                for seed in [int(s) for s in args.seeds.split(",")]:
                    for c in configs:
                        key = f"{mname}/{bits}/{c}/seed{seed}"
                        if key in rows and not args.rerun:
                            continue
                        q = Path(tmp) / f"q-{mname}-{bits}-{seed}-{c.replace('/', '_')}"
                        rep, cost = _run_child(["quantize", model, "-o", str(q), "--bits", str(bits), "--group-size",
                                                str(GROUP_SIZE[mname]), "--samples", str(args.samples), "--seq-len",
                                                str(args.seq_len), "--seed", str(seed), *parse_config(c)])
                        ev, _ = _run_child(["eval", str(q), "--reference", model, "--text", args.text, "--max-tokens",
                                            "4096", "--ctx", "512"])
                        rows[key] = {"kl": ev["kl"], "ppl": ev["ppl"], "reference_ppl": ev["reference_ppl"],
                                     "bytes": ev["bytes"], **cost, **({"block_tune": rep["block_tune"]}
                                                                      if "block_tune" in rep else {})}
                        print(f"{key}: KL {ev['kl']:.4f} ppl {ev['ppl']:.2f} {cost}", flush=True)
                        write_merged(out, {"setup": setup, "runs": rows}, rows="runs")
    return write_merged(out, {"setup": setup, "runs": rows}, rows="runs")


def table(data: dict) -> str:
    rows = data["runs"]
    groups: dict[tuple[str, int, str], dict[int, dict]] = {}
    for key, row in rows.items():
        m, b, rest = key.split("/", 2)
        c, s = rest.rsplit("/", 1)
        groups.setdefault((m, int(b), c), {})[int(s.removeprefix("seed"))] = row
    lines = [f"text {data['setup']['text']}; KL to the original: mean (min-max) over seeds", "",
             "| model | bits | tuning | seeds | MB | KL | gap closed / Δ vs plain | wall s | CPU s | peak RSS MB |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (m, b, c), by_seed in sorted(groups.items()):
        seeds = sorted(by_seed)
        kls = [by_seed[s]["kl"] for s in seeds]
        plain = groups.get((m, b, "none"), {})
        four = groups.get((m, 4, "none"), {})
        if c == "none":
            rel = ""
        elif b == 3:
            fr = [(plain[s]["kl"] - by_seed[s]["kl"]) / (plain[s]["kl"] - four[s]["kl"]) for s in seeds
                  if s in plain and s in four]
            rel = f"{100 * statistics.fmean(fr):.0f}% ({', '.join(f'{100 * x:.0f}' for x in fr)})" if fr else "?"
        else:
            d = [by_seed[s]["kl"] / plain[s]["kl"] - 1 for s in seeds if s in plain]
            rel = f"{100 * statistics.fmean(d):+.1f}%" if d else "?"
        wall, cpu = (statistics.fmean(by_seed[s][k] for s in seeds) for k in ("wall_s", "cpu_s"))
        lines.append(f"| {m} | {b} | {c} | {','.join(map(str, seeds))} | {by_seed[seeds[0]]['bytes'] / 1e6:.1f} | "
                     f"{statistics.fmean(kls):.4f} ({min(kls):.4f}–{max(kls):.4f}) | {rel} | {wall:.0f} | "
                     f"{cpu:.0f} | {max(by_seed[s]['peak_rss_mb'] for s in seeds)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default="bundled:brown-test")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--gemma", default=str(GEMMA))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of STEPS[xBATCH]@LR[/SCALE_LR[/NORM_LR]][:TARGET][~LOSS] "
                                                               "(plain GPTQ always runs)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rerun", action="store_true", help="rerun rows already in the JSON")
    ap.add_argument("--json-out")
    ap.add_argument("--from-json")
    args = ap.parse_args()
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())))
        return
    suffix = "" if args.text == "bundled:brown-test" else "-" + args.text.split(":")[-1]
    if (args.samples, args.seq_len) != (64, 128):
        suffix += f"-{args.samples}x{args.seq_len}"
    args.json_out = args.json_out or str(ROOT / "benchmarks" / "results" / f"block_tune{suffix}.json")
    print(table(run(args)))


if __name__ == "__main__":
    main()
