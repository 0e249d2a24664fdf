"""The evaluation-protocol figures (docs/results/eval.md; the commands are in the README): the bundled model's own perplexity and brown_cloze accuracy.

Run (about 5 minutes on 2 cores)::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/eval_baseline.py      # -> benchmarks/results/eval_baseline.json
    .venv/bin/python benchmarks/eval_baseline.py --from-json benchmarks/results/eval_baseline.json

Each row is one ``python -m layercut.cli eval ... --json`` child process, exactly the command the
README shows (stored under ``command``), and the row keeps that command's JSON line:

- ``test``: ``layercut eval bundled:smollm2-135m --json`` (default text ``bundled:brown-test``, 16,384 tokens, ctx 512)
- ``heldout``: the same on ``bundled:brown-heldout`` (val + test, the pre-split union)
- ``brown_cloze``: ``layercut eval bundled:smollm2-135m --tasks brown_cloze --limit 200 --max-tokens 1024 --json``
- ``brown_cloze_random``: all 400 items on a randomly initialised tiny Llama (hidden 64, 6 blocks,
  seed 0) with a 384-token BPE tokenizer trained on the first 40 ``bundled:brown-calib`` documents:
  the model ``tests/conftest.py`` builds as ``tiny_model_dir("llama")``, so chance-level accuracy
  is measured, not assumed.

Results merge into ``--json-out``: rows not rerun (``--only``) are kept.
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
MODEL = "bundled:smollm2-135m"
ROWS = {
    "test": [MODEL, "--json"],
    "heldout": [MODEL, "--text", "bundled:brown-heldout", "--json"],
    "brown_cloze": [MODEL, "--tasks", "brown_cloze", "--limit", "200", "--max-tokens", "1024", "--json"],
    "brown_cloze_random": ["TINY", "--tasks", "brown_cloze", "--json"],
}


def tiny_llama(path: Path) -> Path:
    """The random tiny Llama of tests/conftest.py (``build_tiny_model("llama")`` + its tokenizer)."""
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from layercut.calibrate.data import load_texts
    from tests.conftest import VOCAB, build_tiny_model

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(load_texts("bundled:brown-calib")[:40], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    build_tiny_model("llama").save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def run_row(name: str, work: Path, threads: int | None) -> dict:
    args = list(ROWS[name])
    shown = "layercut eval " + " ".join(args).replace("TINY", "TINY_LLAMA")
    if args[0] == "TINY":
        args[0] = str(tiny_llama(work / "tiny-llama"))
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "layercut.cli", "-q", "eval", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: row {name} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return {"command": shown, "threads": threads or "CLI default", "wall_s": time.perf_counter() - t0,
            "result": out}


def table(rows: dict) -> str:
    lines = ["| row | command | text | tokens | ppl | task acc (± stderr), items |", "|---|---|---|---:|---:|---|"]
    for name, row in rows.items():
        r = row["result"]
        task = r.get("tasks", {}).get("brown_cloze")
        acc = (f"{task['metrics']['acc']:.3f} ± {task['metrics'].get('acc_stderr', float('nan')):.3f}, "
               f"{task['samples']}" if task else "")
        lines.append(f"| {name} | `{row['command']}` | {r.get('text', '')} | {r.get('tokens', '')} | "
                     f"{r['ppl']:.2f} | {acc} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma list of rows to (re)run, kept with the others: " + ", ".join(ROWS))
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the children (default: the CLI's own)")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/eval_baseline.json"))
    ap.add_argument("--from-json", help="only print the table stored in this JSON")
    args = ap.parse_args()
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())["rows"]))
        return
    names = args.only.split(",") if args.only else list(ROWS)
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        sys.exit(f"error: unknown rows {unknown}; rows: {', '.join(ROWS)}")
    out = Path(args.json_out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data.setdefault("rows", {})
    data["machine"] = f"{platform.machine()}, {os.cpu_count()} CPU cores, shared with other jobs"
    with tempfile.TemporaryDirectory(prefix="layercut-eval-baseline-") as tmp:
        for name in names:
            data["rows"][name] = run_row(name, Path(tmp), args.threads)
            print(f"{name}: {data['rows'][name]['result'].get('ppl'):.3f}", flush=True)
            data["rows"] = {n: data["rows"][n] for n in ROWS if n in data["rows"]}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data["rows"]))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
