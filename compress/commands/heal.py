"""``layercut heal MODEL --teacher ORIGINAL -o OUT [--steps N] [--rank R] [--loss kd|lm|kd+lm] ...``.

LoRA distillation from the original model, merged into dense weights (heal.train).
Checks run before anything is loaded or written: settings, output location, tokenizers,
configs, data. With ``--teacher-topk K`` the teacher runs once over the data, is freed,
and only then is the student loaded, so the two never need to fit in memory together.
"""

from __future__ import annotations

import argparse
import gc
import sys

from compress.errors import LayercutError


def register(sub: argparse._SubParsersAction) -> None:
    from heal.config import HealConfig

    d = HealConfig.model_fields
    p = sub.add_parser("heal", help="LoRA distillation from the original model, merged into dense weights")
    p.add_argument("model", help="the compressed model: HF directory, .gguf file or bundled:NAME")
    p.add_argument("--teacher", help="the original model (needed for kd / kd+lm)")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory")
    p.add_argument("--data", default=d["data"].default, help="training text (default: %(default)s)")
    p.add_argument("--data-offset", type=int, help="token offset into --data (default: 300000 for the "
                                                    "bundled calibration text, else 0)")
    p.add_argument("--samples", type=int, help="distinct sequences (default: steps x batch)")
    p.add_argument("--steps", type=int, default=d["steps"].default)
    p.add_argument("--rank", type=int, default=d["rank"].default)
    p.add_argument("--alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--dropout", type=float, default=d["dropout"].default, help="LoRA dropout")
    p.add_argument("--lr", type=float, default=d["lr"].default)
    p.add_argument("--schedule", choices=["cosine", "constant"], default=d["schedule"].default)
    p.add_argument("--targets", default=d["targets"].default,
                   help="all-linear | mlp | attn | comma list of block linears (default: %(default)s)")
    p.add_argument("--loss", choices=["kd", "lm", "kd+lm"], default=d["loss"].default)
    p.add_argument("--kd-weight", type=float, default=d["kd_weight"].default, help="KD weight in kd+lm")
    p.add_argument("--temperature", type=float, default=d["temperature"].default)
    p.add_argument("--teacher-topk", type=int, help="cache the teacher's top-K log-probs instead of "
                                                    "running it beside the student")
    p.add_argument("--seq-len", type=int, default=d["seq_len"].default)
    p.add_argument("--batch", type=int, default=d["batch"].default, help="sequences per step per process")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="faster, more memory")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save training state every K steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT.heal-state")
    p.add_argument("--save-adapter", action="store_true", help="also keep the peft adapter in OUT/adapter")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the models' own code")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


def _config(args: argparse.Namespace):
    from heal.config import HealConfig

    return HealConfig.parse(
        steps=args.steps, rank=args.rank, alpha=args.alpha, dropout=args.dropout, lr=args.lr,
        schedule=args.schedule, targets=args.targets, loss=args.loss, kd_weight=args.kd_weight,
        temperature=args.temperature, teacher_topk=args.teacher_topk, data=args.data,
        data_offset=args.data_offset, samples=args.samples, seq_len=args.seq_len, batch=args.batch,
        seed=args.seed, gradient_checkpointing=not args.no_gradient_checkpointing,
        checkpoint_every=args.checkpoint_every, resume=args.resume, save_adapter=args.save_adapter,
    )


def _dims(config) -> tuple[int | None, int | None]:
    hidden = getattr(config, "hidden_size", None)
    vocab = getattr(config, "vocab_size", None)
    return hidden, vocab


def _load(spec: str, trust: bool):
    from transformers import AutoConfig

    from compress.models import load_model, resolve_model

    path = resolve_model(spec)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    if getattr(config, "quantization_config", None) is not None:
        try:
            import compress.quant.loader  # noqa: F401
        except ImportError as exc:
            raise LayercutError(f"{path} is quantized and this build has no quantized-checkpoint loader "
                                f"(compress.quant.loader): {exc}") from exc
    return load_model(path, trust_remote_code=trust)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    from compress.models import load_tokenizer, resolve_model
    from export.checkpoint import check_output_dir
    from heal.data import build_topk_cache, heal_data
    from heal.lora import check_tokenizers
    from heal.state import default_state_dir
    from heal.train import heal_model

    cfg = _config(args)
    out = check_output_dir(args.output, args.overwrite)
    if cfg.loss != "lm" and not args.teacher:
        raise LayercutError(f"--loss {cfg.loss} needs --teacher ORIGINAL")
    state = default_state_dir(out)
    if cfg.resume and not state.is_dir():
        raise LayercutError(f"--resume: no heal checkpoint in {state}")
    trust = args.trust_remote_code
    student_path = resolve_model(args.model)
    tokenizer = load_tokenizer(student_path, trust)
    teacher_path = None
    if args.teacher:
        teacher_path = resolve_model(args.teacher)
        check_tokenizers(tokenizer, load_tokenizer(teacher_path, trust))
        s_hidden, s_vocab = _dims(AutoConfig.from_pretrained(student_path, trust_remote_code=trust))
        t_hidden, t_vocab = _dims(AutoConfig.from_pretrained(teacher_path, trust_remote_code=trust))
        if s_vocab != t_vocab:
            raise LayercutError(f"teacher has a different vocabulary ({t_vocab} vs the student's {s_vocab})")
        if s_hidden != t_hidden:
            raise LayercutError(f"student is not a descendant of the teacher: hidden size {s_hidden} vs {t_hidden}")
    data = heal_data(tokenizer, cfg)

    teacher = None
    if teacher_path is not None and cfg.loss != "lm":
        teacher, _ = _load(str(teacher_path), trust)
        if cfg.teacher_topk:
            cache = build_topk_cache(teacher, data, cfg.teacher_topk, cfg.temperature, cfg.batch,
                                     progress=not args.json)
            del teacher
            gc.collect()
            teacher = cache
    student, _ = _load(str(student_path), trust)
    result = heal_model(student, teacher, tokenizer, cfg, out_dir=out, progress=not args.json,
                        data=data, overwrite=args.overwrite)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    report = result.to_dict()
    report.update(model=str(args.model), teacher=str(args.teacher) if args.teacher else None)
    return report
