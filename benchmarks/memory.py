"""Peak RSS of the streamed stages against model size: SmolLM2-135M and random Llama-3-shaped 1B / 3B.

Run::

    python benchmarks/memory.py                       # every model x default stage, writes results/memory.json
    python benchmarks/memory.py --models smollm2-135m --stages eval-streamed,eval-in-memory
    python benchmarks/memory.py --stages eval-quantized-streamed,eval-quantized-whole   # GPTQ checkpoints' eval
    python benchmarks/memory.py --models smollm2-135m --stages quantize-mixed           # not in the default set
    python benchmarks/memory.py --models llama3-1b-2blocks --stages quantize,quantize-mixed   # the 2-block probe
    python benchmarks/memory.py --models llama3-3b-2blocks --stages quantize,quantize-blocktune
    python benchmarks/memory.py --timing --repeats 1 --eval-tokens 4096   # streamed vs whole wall time -> "timing"
    python benchmarks/memory.py --from-json           # print the table from the stored JSON

Every invocation merges into the JSON: rows it does not rerun and the ``timing`` key stay as
stored, and each new row records the ``command`` (flags) that produced it.

Models, all stored in bf16:
- ``smollm2-135m``: the bundled model, converted from its GGUF to bf16;
- ``llama3-1b``, ``llama3-3b``: Llama-3.2-1B / 3B shapes (128,256-token vocabulary, tied
  embeddings) with random weights, written one tensor at a time by
  :class:`layercut.compress.core.shards.ShardWriter` under ``$LAYERCUT_CACHE/bench-models``. Random
  weights are valid for memory and time, not for quality. They use SmolLM2's tokenizer
  (its ids are a subset of the vocabulary).

Each (model, stage) runs in its own subprocess with one torch thread; its peak RSS is the
child's ``ru_maxrss`` (the whole process: Python, torch and transformers included, about
0.4 GiB before any weight). The target for every size is
``peak <= 0.5 x bf16 checkpoint bytes + 1 GiB``.

Stages measured, each through its stage's ``run`` (what ``layercut <stage>`` calls);
heal (LoRA) loads the whole model; heal-qlora and heal-scales hold the packed 4-bit blocks whole and
stream the rest:
- ``eval-streamed``: perplexity and exact KL to a reference (the same checkpoint), one
  block in memory at a time (the default; :mod:`layercut.compress.eval.stream_eval`);
- ``eval-in-memory``: ``--whole-model``, the whole model in float32 (SmolLM2 only);
- ``score``: angular + block-influence scores, streamed;
- ``prune-drop``: remove blocks 1 and 2, checkpoint to checkpoint tensor by tensor
  (2 GB output shards, so up to 2 GB of output is buffered);
- ``prune-lstsq``: the same with a least-squares map fitted over the streamed driver;
- ``quantize``: GPTQ 4-bit g128 (g64 on SmolLM2, whose 576 inputs 128 does not divide), each
  block quantized, written and freed at its turn;
- ``heal``: 2 LoRA steps (rank 4, batch 1 × 64 tokens, the teacher's top-64 cache, the model as
  its own teacher) over the whole model in its own dtype (bf16), merged and written;
- ``heal-qlora``: ``heal --method qlora`` of the bf16 model (its own teacher, top-64 cache streamed): the
  4-bit RTN copy written beside the output (inside the measured process), 2 LoRA steps (rank 4, batch 1 × 64
  tokens) over it, the adapters merged into the bf16 weights tensor by tensor;
- ``heal-scales``: ``heal --method scales`` of the model's 4-bit GPTQ checkpoint (the one the
  eval-quantized rows read) toward the bf16 original (its top-64 cache): 2 steps of batch 1 × 64 tokens,
  the tuned checkpoint written. The row's ``bf16_bytes`` and target are the original's.
- ``export``: a release checkpoint (card included), copied tensor by tensor in the source's dtype.
- ``eval-quantized-streamed``: ``layercut eval`` of a 4-bit GPTQ checkpoint of the model (group size as in
  ``quantize``) with exact KL to the bf16 original as the reference, both streamed one block at a time
  (the quantized blocks' packed tensors read for their turn; :mod:`layercut.compress.eval.stream_eval`).
  The row's ``bf16_bytes`` and target are the bf16 original's; ``quant_bytes`` is the checkpoint's.
- ``eval-quantized-whole``: the same with ``--whole-model`` (both models whole, non-quantized tensors in
  float32: what every quantized eval did before), for contrast; SmolLM2 and 1B only (the 3B's fp32
  reference alone would be 13 GB).
  The 4-bit checkpoints are written once per model by ``--prepare-quantized`` (outside the measured
  process) under ``$LAYERCUT_CACHE/bench-models``, with the quantize stage's streamed path:
  SmolLM2 with GPTQ on 4 × 256 calibration tokens; the random 1B with GPTQ on only 2 × 64 tokens and
  the random 3B with RTN (same GPTQ v1 tensors, shapes and ``quantization_config``; GPTQ's solve at
  3B took 3,000 s in the ``quantize`` row, on a less loaded machine). Quality is meaningless on random weights; the eval's
  memory depends only on the tensors' shapes and dtypes, which the method does not change.
- ``quantize-mixed`` (only with ``--stages``): ``--avg-bits 3.5`` with the default candidates,
  the loss sensitivity on 2 sequences and the fallback check, all streamed. At 1B it takes hours
  on 2 cores, so it is measured on ``llama3-1b-2blocks`` (the 1B's shapes and embedding, 2 of its
  16 blocks): the streamed peak follows the largest block and the embedding, not the depth, so
  its uniform ``quantize`` row beside it shows how the two compare.
- ``quantize-blocktune`` (only with ``--stages``): ``quantize --bits 4 --block-tune`` with 10 tuning steps
  per block (``--blocktune-steps``; from the second step on, each step holds the same tensors as the one
  before: the optimizer's state, made by the first, beside the second's activations and gradients;
  the quantize default is 100), measured on ``llama3-3b-2blocks``
  (the 3B's shapes and embedding, 2 of its 28 blocks) beside that probe's plain ``quantize`` row, and
  on the full ``llama3-3b`` with 2 steps a block (28 blocks x 10 steps would take hours here), read
  against its target (0.5 x its bf16 bytes + 1 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

# run from a checkout without install
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64),
    "llama3-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                      num_key_value_heads=8, head_dim=128),
}
MODELS = ["smollm2-135m", "llama3-1b", "llama3-3b"]
STAGES = ["eval-streamed", "eval-in-memory", "score", "prune-drop", "prune-lstsq", "quantize", "heal", "heal-qlora",
          "heal-scales", "export", "eval-quantized-streamed", "eval-quantized-whole"]
QUANTIZED_STAGES = ("eval-quantized-streamed", "eval-quantized-whole")
NEEDS_QUANTIZED = (*QUANTIZED_STAGES, "heal-scales")  # the rows that read the model's 4-bit checkpoint
# how the 4-bit checkpoint each eval-quantized row reads is made: (method, calibration sequences, tokens each)
QUANT_RECIPE = {"smollm2-135m": ("gptq", 4, 256), "llama3-1b": ("gptq", 2, 64), "llama3-3b": ("rtn", 1, 16)}
# --stages only: --avg-bits 3.5 (default candidates, fallback check on), hours at 1B on 2 cores; and the
# 1B shape with 2 of its 16 blocks, whose per-block peak (which is what the streamed peak follows) is the 1B's
EXTRA_STAGES = ["quantize-mixed", "quantize-blocktune"]
SHAPES["llama3-1b-2blocks"] = dict(SHAPES["llama3-1b"], num_hidden_layers=2)
SHAPES["llama3-3b-2blocks"] = dict(SHAPES["llama3-3b"], num_hidden_layers=2)
BLOCKTUNE_STEPS = 10


def model_dir(name: str) -> Path:
    import torch

    from layercut.compress.io.models import cache_dir, load_tokenizer, resolve_model

    if name == "smollm2-135m":
        return resolve_model("bundled:smollm2-135m", convert_dtype=torch.bfloat16)
    if name == "smollm2-135m-fp32":  # the timing comparison: what the in-memory path has always used
        return resolve_model("bundled:smollm2-135m")
    folder = cache_dir() / "bench-models" / f"{name}-random-bf16"
    if (folder / "config.json").is_file():
        return folder
    write_random_llama(folder, SHAPES[name], load_tokenizer("bundled:smollm2-135m"))
    return folder


def group_size(name: str) -> int:
    return 64 if name.startswith("smollm2") else 128  # SmolLM2's 576 inputs are not a multiple of 128


def quantized_dir(name: str) -> Path:
    """The 4-bit checkpoint of ``name`` the eval-quantized rows read (written once; see the module doc)."""
    from layercut.compress.io.models import cache_dir
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.stages.base import RunEnv
    from layercut.compress.workflow.stages.quantize import run as run_quantize

    method, samples, seq_len = QUANT_RECIPE[name]
    folder = cache_dir() / "bench-models" / f"{name}-{method}-4bit-g{group_size(name)}"
    if not (folder / "config.json").is_file():
        cfg = QuantizeConfig(bits=4, group_size=group_size(name), method=method, samples=samples, seq_len=seq_len,
                             batch_size=2)
        run_quantize(cfg, str(model_dir(name)), folder, env=RunEnv(progress=False))  # atomic: all or nothing
    return folder


def write_random_llama(folder: Path, shape: dict, tokenizer) -> None:
    """A Llama-3-shaped bf16 checkpoint with random weights, one tensor at a time (never a model)."""
    import shutil
    import tempfile

    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from layercut.compress.core.shards import ShardWriter

    config = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, dtype="bfloat16", **shape)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    gen = torch.Generator().manual_seed(0)
    with ShardWriter(tmp, "2GB") as writer:
        for name, param in skeleton.named_parameters():
            if name == "lm_head.weight":
                continue  # tied to the embedding
            if "norm" in name:
                tensor = torch.ones(param.shape, dtype=torch.bfloat16)
            else:
                tensor = (torch.randn(param.shape, generator=gen) * 0.02).to(torch.bfloat16)
            writer.add(name, tensor)
            del tensor
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():  # written meanwhile by another run
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, folder)


def child(name: str, stage: str, eval_tokens: int, samples: int, seq_len: int,
          blocktune_steps: int = BLOCKTUNE_STEPS) -> dict:
    import torch

    from layercut.compress.io.models import weight_bytes
    from layercut.compress.workflow.stages.base import RunEnv

    torch.set_num_threads(1)
    path = model_dir(name)
    out = {"model": name, "stage": stage, "bf16_bytes": weight_bytes(path)}
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if stage in ("eval-streamed", "eval-in-memory"):
        from layercut.compress.eval.config import EvalConfig
        from layercut.compress.workflow.stages.eval import run as run_eval

        whole = stage == "eval-in-memory" or bool(os.environ.get("LAYERCUT_BENCH_WHOLE"))
        # timing: no reference (the whole-model path evaluates a reference twice: KL pass + its own figures)
        reference = None if os.environ.get("LAYERCUT_BENCH_TIMING") else str(path)
        cfg = EvalConfig(max_tokens=eval_tokens, reference=reference, whole_model=whole)
        res = run_eval(cfg, str(path), env=RunEnv(progress=False))["model"]
        out.update(ppl=res["ppl"], kl=res["kl"], tokens=res["tokens"])
    elif stage in QUANTIZED_STAGES:
        from layercut.compress.eval.config import EvalConfig
        from layercut.compress.workflow.stages.eval import run as run_eval

        qpath = quantized_dir(name)  # made by --prepare-quantized, outside this process's peak
        cfg = EvalConfig(max_tokens=eval_tokens, reference=str(path), whole_model=stage == "eval-quantized-whole")
        res = run_eval(cfg, str(qpath), env=RunEnv(progress=False))["model"]
        method, n, seq = QUANT_RECIPE[name]
        out.update(ppl=res["ppl"], kl=res["kl"], tokens=res["tokens"], quant_bytes=weight_bytes(qpath),
                   quantized=f"4-bit g{group_size(name)} {method.upper()}, calibration {n} x {seq}")
    elif stage == "score":
        from layercut.compress.select.config import ScoreConfig
        from layercut.compress.workflow.stages.score import run as run_score

        cfg = ScoreConfig(method="angular,block-influence", drop=2, samples=samples, seq_len=seq_len)
        run_score(cfg, str(path), env=RunEnv(progress=False))
        out.update(tokens=samples * seq_len)
    elif stage in ("prune-drop", "prune-lstsq"):
        import tempfile

        from layercut.compress.depth.config import PruneConfig
        from layercut.compress.workflow.stages.prune import run as run_prune

        lstsq = dict(replace="lstsq", samples=samples, seq_len=seq_len) if stage == "prune-lstsq" else {}
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            whole = bool(os.environ.get("LAYERCUT_BENCH_WHOLE"))
            report = run_prune(PruneConfig(layers=[1, 2], whole_model=whole, **lstsq), str(path), Path(tmp) / "out",
                               env=RunEnv(progress=False))
        out.update(layers_after=report["num_layers_after"], tokens=samples * seq_len if lstsq else "")
    elif stage in ("quantize", "quantize-mixed", "quantize-blocktune"):
        import tempfile

        from layercut.compress.quant.config import QuantizeConfig
        from layercut.compress.workflow.stages.quantize import run as run_quantize

        group = group_size(name)
        bits = dict(avg_bits=3.5, sensitivity_samples=2) if stage == "quantize-mixed" else dict(bits=4)
        if stage == "quantize-blocktune":
            bits.update(block_tune=True, block_tune_steps=blocktune_steps)
        cfg = QuantizeConfig(**bits, group_size=group, samples=samples, seq_len=seq_len, batch_size=4,
                             whole_model=bool(os.environ.get("LAYERCUT_BENCH_WHOLE")))
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            report = run_quantize(cfg, str(path), Path(tmp) / "out", env=RunEnv(progress=False))
        out.update(avg_bits=report["avg_bits"], group_size=group, tokens=samples * seq_len)
        if stage == "quantize-blocktune":
            out.update(block_tune_steps=blocktune_steps)
        if stage == "quantize-mixed":
            out.update(written=report["written"], solve_dtype=report["solve_dtype"])
        else:
            out.update(solve_dtype=report["solve_dtype"])
    elif stage == "heal-scales":
        import tempfile

        from layercut.compress.workflow.stages.heal import run as run_heal
        from layercut.heal.config import HealConfig

        qpath = quantized_dir(name)  # made by --prepare-quantized, outside this process's peak
        cfg = HealConfig(method="scales", teacher=str(path), steps=2, samples=2, seq_len=64, batch_size=1,
                         data_offset=0)
        with tempfile.TemporaryDirectory(dir=qpath.parent) as tmp:
            run_heal(cfg, str(qpath), Path(tmp) / "out", env=RunEnv(progress=False))
        method, n, seq = QUANT_RECIPE[name]
        out.update(tokens=2 * 64, quant_bytes=weight_bytes(qpath),
                   quantized=f"4-bit g{group_size(name)} {method.upper()}, calibration {n} x {seq}")
    elif stage == "heal-qlora":
        import tempfile

        from layercut.compress.workflow.stages.heal import run as run_heal
        from layercut.heal.config import HealConfig

        cfg = HealConfig(method="qlora", teacher=str(path), steps=2, samples=2, seq_len=64, batch_size=1, rank=4,
                         data_offset=0)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            run_heal(cfg, str(path), Path(tmp) / "out", env=RunEnv(progress=False))
        out.update(tokens=2 * 64)
    elif stage in ("heal", "export"):
        import tempfile

        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            if stage == "heal":
                from layercut.compress.workflow.stages.heal import run as run_heal
                from layercut.heal.config import HealConfig

                cfg = HealConfig(teacher=str(path), steps=2, samples=2, seq_len=64, batch_size=1, rank=4, data_offset=0)
                run_heal(cfg, str(path), Path(tmp) / "out", env=RunEnv(progress=False))
                out.update(tokens=2 * 64)
            else:
                from layercut.compress.workflow.stages.export import run as run_export
                from layercut.export.config import ExportConfig

                run_export(ExportConfig(), str(path), Path(tmp) / "out", env=RunEnv(progress=False))
    else:
        raise SystemExit(f"unknown stage {stage}")
    out["seconds"] = time.perf_counter() - start
    out["rss_before_stage_mb"] = base_rss / 1024
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


TIMED = {"eval": "eval-streamed", "prune-lstsq": "prune-lstsq", "quantize": "quantize"}


def timing(args, out_path: Path) -> None:
    """Streamed vs whole-model wall time of the same stage on SmolLM2 (its fp32 conversion), in one run:
    the two paths alternate, each in its own one-thread process, ``--repeats`` times."""
    rows = []
    for stage, child_stage in TIMED.items():
        for variant in ("streamed", "whole"):
            for rep in range(args.repeats):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "LAYERCUT_BENCH_TIMING": "1",
                       "LAYERCUT_BENCH_WHOLE": "1" if variant == "whole" else ""}
                proc = subprocess.run([sys.executable, __file__, "--child", "smollm2-135m-fp32", child_stage,
                                       "--eval-tokens", str(args.eval_tokens), "--samples", str(args.samples),
                                       "--seq-len", str(args.seq_len)], capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"timing {stage} {variant} failed")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append({"stage": stage, "variant": variant, "repeat": rep, "seconds": r["seconds"],
                             "peak_rss_mb": r["peak_rss_mb"], "ppl": r.get("ppl"), "avg_bits": r.get("avg_bits")})
                print(f"{stage:12s} {variant:8s} {r['seconds']:7.1f} s  {r['peak_rss_mb']:7.0f} MB", flush=True)
    lines = ["| stage | streamed s (min) | whole model s (min) | ratio | streamed peak MB | whole peak MB |",
             "|---|---:|---:|---:|---:|---:|"]
    for stage in TIMED:
        s_ = min(r["seconds"] for r in rows if r["stage"] == stage and r["variant"] == "streamed")
        w_ = min(r["seconds"] for r in rows if r["stage"] == stage and r["variant"] == "whole")
        sp = max(r["peak_rss_mb"] for r in rows if r["stage"] == stage and r["variant"] == "streamed")
        wp = max(r["peak_rss_mb"] for r in rows if r["stage"] == stage and r["variant"] == "whole")
        lines.append(f"| {stage} | {s_:.1f} | {w_:.1f} | {s_ / w_:.2f} | {sp:.0f} | {wp:.0f} |")
    print("\n".join(lines))
    data = json.loads(out_path.read_text()) if out_path.is_file() else {"rows": []}
    data["timing"] = {"model": "bundled:smollm2-135m (fp32 conversion)", "repeats": args.repeats,
                      "eval_tokens": args.eval_tokens, "calib": f"{args.samples} x {args.seq_len}", "rows": rows,
                      "table": lines}
    tmp = out_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, out_path)


ORDER = [*MODELS, "llama3-1b-2blocks", "llama3-3b-2blocks"]
WHOLE = ("eval-in-memory", "heal", "eval-quantized-whole")  # load the whole model: the streaming target does not apply


def table(rows: list[dict]) -> str:
    lines = ["| model | stage | bf16 checkpoint GiB | peak RSS GiB | target GiB | within | s | tokens |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        gib = r["bf16_bytes"] / 2**30
        target = 0.5 * gib + 1.0
        peak = r["peak_rss_mb"] / 1024
        within = "whole model" if r["stage"] in WHOLE else "yes" if peak <= target else "NO"
        if r["model"].endswith("-2blocks"):
            within = "2-block probe"  # its target would be its own (mostly embedding) bytes: compare with the full
        lines.append(f"| {r['model']} | {r['stage']} | {gib:.2f} | {peak:.2f} | {target:.2f} | "
                     f"{within} | {r['seconds']:.0f} | {r.get('tokens', '')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--eval-tokens", type=int, default=1024, help="evaluation tokens (ctx 512)")
    ap.add_argument("--samples", type=int, default=4, help="score: calibration sequences")
    ap.add_argument("--seq-len", type=int, default=256, help="score: calibration sequence length")
    ap.add_argument("--blocktune-steps", type=int, default=BLOCKTUNE_STEPS,
                    help="quantize-blocktune: tuning steps a block (default %(default)s)")
    ap.add_argument("--json-out", default=str(RESULTS / "memory.json"))
    ap.add_argument("--from-json", action="store_true", help="print the stored table only")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "STAGE"), help=argparse.SUPPRESS)
    ap.add_argument("--prepare", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--prepare-quantized", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--timing", action="store_true",
                    help="wall time streamed vs whole model on SmolLM2 (fp32), alternating, --repeats each")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.blocktune_steps < 1:
        ap.error("--blocktune-steps must be at least 1")
    if args.prepare:  # conversion / random-checkpoint writing stays out of the stage's own peak
        print(model_dir(args.prepare))
        return
    if args.prepare_quantized:  # so does quantizing it for the eval-quantized rows
        import torch

        torch.set_num_threads(1)
        print(quantized_dir(args.prepare_quantized))
        return
    if args.child:
        print(json.dumps(child(*args.child, args.eval_tokens, args.samples, args.seq_len, args.blocktune_steps)))
        return
    out_path = Path(args.json_out)
    if args.timing:
        timing(args, out_path)
        return
    if args.from_json:
        print(table(json.loads(out_path.read_text())["rows"]))
        return
    previous = json.loads(out_path.read_text()) if out_path.is_file() else {"rows": []}
    rows = {(r["model"], r["stage"]): r for r in previous["rows"]}
    for name in args.models.split(","):
        subprocess.run([sys.executable, __file__, "--prepare", name], check=True, capture_output=True)
        if any(s in NEEDS_QUANTIZED for s in args.stages.split(",")):
            subprocess.run([sys.executable, __file__, "--prepare-quantized", name], check=True, capture_output=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        for stage in args.stages.split(","):
            if stage == "eval-in-memory" and name != "smollm2-135m":
                continue  # the whole-model path: measured on the small model only
            if stage == "eval-quantized-whole" and name == "llama3-3b":
                continue  # both models whole in float32: 13 GB of reference alone
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            steps = ["--blocktune-steps", str(args.blocktune_steps)] if stage == "quantize-blocktune" else []
            proc = subprocess.run([sys.executable, __file__, "--child", name, stage,
                                   "--eval-tokens", str(args.eval_tokens), "--samples", str(args.samples),
                                   "--seq-len", str(args.seq_len), *steps], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} {stage} failed")
            rows[(name, stage)] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                                   "command": f"python benchmarks/memory.py --models {name} --stages {stage}"
                                              f" --eval-tokens {args.eval_tokens} --samples {args.samples}"
                                              f" --seq-len {args.seq_len}" + (" " + " ".join(steps) if steps else "")}
            print(table([rows[(name, stage)]]).splitlines()[-1], flush=True)
            # merge, never drop: keys this run does not produce (``timing``, rows of other models or
            # stages) stay as stored
            result = {**previous, "machine": platform.machine(), "cpus": os.cpu_count(),
                      "eval_tokens": args.eval_tokens, "score_tokens": f"{args.samples} x {args.seq_len}",
                      "rows": sorted(rows.values(), key=lambda r: (ORDER.index(r["model"]), r["stage"]))}
            tmp = out_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(result, indent=2) + "\n")
            os.replace(tmp, out_path)
    print(table(json.loads(out_path.read_text())["rows"]))


if __name__ == "__main__":
    main()
