"""The demo run's figures: wall time, peak RSS and summary table of ``layercut run recipes/smollm2-demo.yaml``.

Run (about 4 minutes on 2 free CPU cores; longer on a loaded machine)::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo.py
    .venv/bin/python benchmarks/demo.py --from-json benchmarks/results/demo.json   # print the stored figures

First converts the bundled model once if it is not in the layercut cache yet (a separate
process, timed as ``convert_s``, so the measured run is the README's "bundled model
already converted" case). Then runs ``python -m compress.cli run RECIPE -o RUN_DIR`` in one
child process with the CLI's own thread settings and measures its wall time, its CPU time
and its peak RSS (``os.wait4``: the child's own high-water mark). Writes
``benchmarks/results/demo.json``: those figures, the machine, and the run's ``report.json``
verbatim under ``"report"``; prints them with the run's summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def summary(result: dict) -> str:
    from compress.pipeline import summary_table

    return "\n".join([
        f"`{result['command']}` on {result['machine']} (load average {result['load_avg_before'][0]:.1f} before "
        f"the run): {int(result['wall_s'] // 60)} min {result['wall_s'] % 60:.0f} s wall, peak RSS "
        f"{result['peak_rss_mb'] / 1024:.1f} GiB ({result['peak_rss_mb']:.0f} MiB), CPU {result['cpu_s']:.0f} s; "
        f"bundled-model conversion before the run: {result['convert_s']:.1f} s.",
        "",
        summary_table(result["report"]),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2-demo.yaml")
    ap.add_argument("--run-dir", help="where the run goes (default: a new temp dir); must not exist")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/demo.json"))
    ap.add_argument("--from-json", help="only print the figures stored in this JSON")
    args = ap.parse_args()
    if args.from_json:
        print(summary(json.loads(Path(args.from_json).read_text())))
        return

    from compress.recipe import Recipe

    model = Recipe.from_yaml(ROOT / args.recipe).model
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"from compress.models import resolve_model; resolve_model({model!r})"],
                   cwd=ROOT, check=True)
    convert_s = time.perf_counter() - t0

    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="layercut-demo-")) / "demo"
    log = run_dir.parent / f"{run_dir.name}.log"
    load_before = os.getloadavg()
    with open(log, "w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "compress.cli", "run", args.recipe, "-o", str(run_dir)],
                                cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"error: the demo run failed (exit {code}); log: {log}")
    result = {
        "command": f"layercut run {args.recipe} -o RUN_DIR",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "load_avg_before": list(load_before),
        "convert_s": convert_s,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # ru_maxrss is in KiB on Linux
        "report": json.loads((run_dir / "report.json").read_text()),
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    print(f"\nwrote {out}; run folder {run_dir}")


if __name__ == "__main__":
    main()
