"""How far the quantize config travels: from the stage's ``run(config, ...)`` to the written
checkpoint, traced on a tiny model (2 Llama blocks, 8 × 32 calibration tokens, streamed run).

A **step** is a call into a layercut function that receives the quantize config or an object
made from it (a pydantic model or dataclass of ``layercut.compress.quant`` whose class name ends
in ``Config`` or ``Plan``: ``QuantizeConfig``, ``SolverConfig``, ``QuantPlan``) as an argument.
Counted: the steps (calls; a per-block function counts once per call), the distinct functions
and files they enter, and the **climbs**: steps that re-enter a file the walk already left (the
reader goes back to a file seen before), how often a ``check`` method runs, and the config's
shapes (the classes it takes on the way). Fewer of each: the config is easier to follow.

    python benchmarks/config_walk.py                       # this checkout
    python benchmarks/config_walk.py --json out.json       # also write JSON

It imports the stage through either layout (``layercut.compress.workflow.stages`` or the
older ``layercut.compress.stages``), so the same script measures a tree before and after a move.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch  # noqa: E402
import transformers as T  # noqa: E402


def _stage():
    for name in ("layercut.compress.workflow.stages.quantize", "layercut.compress.stages.quantize"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit("no quantize stage module found")


def _tiny_checkpoint(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from layercut.calibrate.data import load_texts

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(load_texts("bundled:brown-calib")[:40], trainer)
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    fast.save_pretrained(folder)


def _is_config(value: object, root: object) -> bool:
    if value is root:
        return True
    cls = type(value)
    return cls.__module__.startswith("layercut.compress.quant") and cls.__name__.endswith(("Config", "Plan")) \
        and (dataclasses.is_dataclass(value) or hasattr(cls, "model_fields"))


def walk() -> dict:
    from layercut.compress.quant.config import QuantizeConfig

    stage = _stage()
    src_roots = tuple(str(Path(importlib.import_module(p).__file__).parent)
                      for p in ("layercut", "layercut.compress", "layercut.calibrate", "layercut.heal",
                                "layercut.export"))
    steps: list[str] = []
    shapes: list[str] = []  # the config's classes, in the order the walk meets them
    with tempfile.TemporaryDirectory() as tmp:
        _tiny_checkpoint(Path(tmp) / "src")
        config = QuantizeConfig(bits=4, group_size=32, samples=8, seq_len=32)

        def tracer(frame, event, arg):
            if event != "call":
                return None
            code = frame.f_code
            if not code.co_filename.startswith(src_roots):
                return None
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            found = [frame.f_locals.get(n) for n in names if _is_config(frame.f_locals.get(n), config)]
            if found:
                steps.append(f"{code.co_filename}:{code.co_name}")
                for value in found:
                    if type(value).__name__ not in shapes:
                        shapes.append(type(value).__name__)
            return None

        sys.setprofile(None)
        sys.settrace(tracer)
        try:
            stage.run(config, str(Path(tmp) / "src"), str(Path(tmp) / "out"))
        finally:
            sys.settrace(None)
    files = [s.rsplit(":", 1)[0] for s in steps]
    climbs, seen, prev = 0, set(), None
    for f in files:
        if f != prev and f in seen:
            climbs += 1
        seen.add(f)
        prev = f
    common = Path(*Path(files[0]).parts[: len(Path(files[0]).parts) - 3]) if files else Path()
    checks = sum(s.rsplit(":", 1)[1] == "check" for s in steps)
    return {"steps": len(steps), "functions": len(set(steps)), "files": len(set(files)), "climbs": climbs,
            "check_calls": checks, "shapes": shapes,
            "walk": [str(Path(s).relative_to(common)) if s.startswith(str(common)) else s for s in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures and the walk here")
    args = parser.parse_args()
    result = walk()
    print("| steps | functions | files | climbs | .check() calls | the config's shapes |\n|---|---|---|---|---|---|")
    print(f"| {result['steps']} | {result['functions']} | {result['files']} | {result['climbs']} | "
          f"{result['check_calls']} | {' → '.join(result['shapes'])} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
