"""The heal stage: distillation from the original model. ``--method lora`` (the default) trains
LoRA adapters and merges them into dense weights; ``--method scales`` trains a GPTQ checkpoint's
group scales in place (``layercut.heal.scales``), so its codes, zeros and bytes stay.

Run it::

    layercut heal pruned/ --teacher bundled:smollm2-135m -o healed/ --steps 200

    from layercut.compress.workflow.stages.heal import run
    from layercut.heal.config import HealConfig          # the config lives with the algorithm
    run(HealConfig(steps=200, teacher="bundled:smollm2-135m"), "pruned/", "healed/")

    from layercut.heal.train import heal_model                   # in memory: the same config
    result = heal_model(student, teacher, tokenizer, HealConfig(steps=200))

Checks run before anything is loaded or written: settings, output location, tokenizers,
configs, data. With ``teacher_topk`` (default 64; 0 turns it off) the teacher runs once over the data, is freed, and
only then is the student loaded, so the two never need to fit in memory together. Rank,
alpha, learning rate and loss default to what ``benchmarks/heal.py`` measured on SmolLM2
with 8 blocks removed (``docs/results/heal.md``).
"""

from __future__ import annotations

import gc
import json
import logging
import tempfile
from pathlib import Path

from layercut.compress.core.devices import on_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import check_output_dir
from layercut.compress.io.lazy import trim_heap
from layercut.compress.io.models import load_model, load_tokenizer, resolve_model
from layercut.compress.options import torch_dtype
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.workflow.stages.base import RunEnv, strip_volatile
from layercut.compress.workflow.stages.quantize import run as run_quantize
from layercut.heal.config import HealConfig
from layercut.heal.data import build_topk_cache_streamed, distill_target, heal_data
from layercut.heal.lora import check_dims, check_tokenizers
from layercut.heal.qlora import BASE_GROUP_SIZE, heal_qlora
from layercut.heal.scales import tune_scales
from layercut.heal.state import default_state_dir
from layercut.heal.train import heal_model

log = logging.getLogger("layercut.heal")
def _train_dtype(name: str, path):
    """``--dtype`` for training: ``auto`` keeps bf16/fp32 checkpoints as they are, but loads fp16 ones
    (no loss scaling here) and GPTQ ones (dequantized into dense layers) in float32."""
    import json

    import torch

    dtype = torch_dtype(name, path)
    if name == "auto" and (dtype == torch.float16 or "quantization_config" in json.loads(
            (Path(path) / "config.json").read_text())):
        return torch.float32
    return dtype




def _student_dtype(config: HealConfig, path):
    """The dtype the student loads in. Scale tuning with ``--dtype auto`` loads a GPTQ checkpoint's unquantized
    tensors as stored (16-bit) and upcasts all but the embedding and head afterwards
    (:func:`layercut.heal.scales.train_dtype_except_embeddings`): at 1B a float32 embedding alone is 1 GiB."""
    import torch

    if config.method in ("scales", "qlora") and config.dtype == "auto":
        return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(str(_stored_dtype(path)), torch.float32)
    return _train_dtype(config.dtype, path)


def _stored_dtype(path) -> str | None:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")


def _dims(config) -> tuple[int | None, int | None, int | None]:
    return (getattr(config, "hidden_size", None), getattr(config, "vocab_size", None),
            getattr(config, "num_hidden_layers", None))


@on_device
def run(config: HealConfig, source: str | Path, output: str | Path, env: RunEnv | None = None) -> dict:
    """Heal ``source`` by distillation from ``config.teacher``; write the merged model to ``output``.

    Returns the report; ``heal.json`` in the checkpoint holds it without timings or paths.
    """
    from transformers import AutoConfig

    env = env or RunEnv()
    out = check_output_dir(output, env.overwrite)
    if config.loss != "lm" and config.teacher is None:
        raise LayercutError(f"--loss {config.loss} needs a teacher (--teacher ORIGINAL)")
    state = default_state_dir(out)
    if config.resume and not state.is_dir():
        raise LayercutError(f"--resume: no heal checkpoint in {state}")
    trust = env.trust_remote_code
    student_path = resolve_model(source)
    quantized = "quantization_config" in json.loads((student_path / "config.json").read_text())
    if config.method == "scales" and not quantized:
        raise LayercutError(f"heal --method scales tunes a GPTQ checkpoint's scales, and {source} is not one: "
                            "quantize it first (layercut quantize), or heal it with --method lora")
    if config.method == "qlora" and quantized:
        raise LayercutError(f"heal --method qlora trains over a 4-bit copy of a dense checkpoint, and {source} is "
                            "already quantized: tune its scales with --method scales")
    tokenizer = load_tokenizer(student_path, trust)
    teacher_path = env.resolve(config.teacher, "teacher")
    if teacher_path is not None:
        check_tokenizers(tokenizer, load_tokenizer(teacher_path, trust))
        check_dims(_dims(AutoConfig.from_pretrained(student_path, trust_remote_code=trust)),
                   _dims(AutoConfig.from_pretrained(teacher_path, trust_remote_code=trust)))
    data = heal_data(tokenizer, config)

    teacher = None
    if teacher_path is not None and config.loss != "lm":
        teacher = None
        if config.method in ("scales", "qlora") and config.teacher_topk:
            try:  # the teacher streamed one block at a time: never resident whole
                teacher = build_topk_cache_streamed(teacher_path, data, config.teacher_topk, config.temperature,
                                                    config.batch_size, env.progress,
                                                    _train_dtype(config.dtype, teacher_path), trust)
            except LayercutError as exc:  # an architecture or checkpoint the streaming loader does not take
                log.info("teacher top-k: streaming unavailable (%s); loading the whole teacher", exc)
        if teacher is None:
            teacher, _ = load_model(teacher_path, dtype=_train_dtype(config.dtype, teacher_path), trust_remote_code=trust)
            teacher = distill_target(teacher, data, config, env.progress)  # a top-k cache: the model is freed
        gc.collect()
        trim_heap()  # the streamed teacher's freed blocks go back to the OS before the student loads
    if config.method == "qlora":
        result = _qlora(config, student_path, teacher, tokenizer, data, out, env)
    else:
        result = _dense_or_scales(config, student_path, teacher, tokenizer, data, out, env)
    return _report(config, source, out, result)


def _dense_or_scales(config: HealConfig, student_path: Path, teacher, tokenizer, data, out: Path, env: RunEnv):
    student, _ = load_model(student_path, dtype=_student_dtype(config, student_path),
                            trust_remote_code=env.trust_remote_code)
    if config.method == "scales":
        result = tune_scales(student, teacher, tokenizer, config, student_path, out_dir=out, progress=env.progress,
                             data=data, overwrite=env.overwrite)
    else:
        result = heal_model(student, teacher, tokenizer, config, out_dir=out, progress=env.progress, data=data,
                            overwrite=env.overwrite)
    return result


def _qlora(config: HealConfig, student_path: Path, teacher, tokenizer, data, out: Path, env: RunEnv):
    """The student quantized with RTN into a temporary GPTQ checkpoint beside OUT (streamed, one block at a
    time), loaded packed, healed with LoRA over it; the adapters merged into ``student_path``'s dense weights."""
    qcfg = QuantizeConfig(bits=config.base_bits, group_size=BASE_GROUP_SIZE, method="rtn", device=config.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.qlora-base-", dir=out.parent) as tmp:
        base_dir = Path(tmp) / "base"
        log.info("qlora: a %d-bit RTN copy of the student (group size %d)", config.base_bits, BASE_GROUP_SIZE)
        run_quantize(qcfg, str(student_path), base_dir,
                     env=RunEnv(progress=env.progress, trust_remote_code=env.trust_remote_code))
        trim_heap()
        base, _ = load_model(base_dir, dtype=_student_dtype(config, base_dir), trust_remote_code=env.trust_remote_code)
        return heal_qlora(base, teacher, tokenizer, config, student_path, out_dir=out, progress=env.progress,
                          data=data, overwrite=env.overwrite)


def _report(config: HealConfig, source, out: Path, result) -> dict:
    for note in result.notes:
        log.warning("note: %s", note)
    info_file = out / "heal.json"
    losses: list[float] = []
    if info_file.is_file():  # no timings or paths inside the checkpoint: reruns are byte-identical
        info = strip_volatile(json.loads(info_file.read_text()))
        info_file.write_text(json.dumps(info, indent=2, default=str) + "\n")
        losses = info.get("losses") or []
    report = result.to_dict()
    # first/last quarter of the steps (heal's own loss_first/last average 10 steps, which overlap on short runs)
    k = max(1, len(losses) // 4)
    if losses:
        report["loss_start"], report["loss_end"] = sum(losses[:k]) / k, sum(losses[-k:]) / k
    else:
        report["loss_start"], report["loss_end"] = report.get("loss_first"), report.get("loss_last")
    report["loss_window"] = k
    report.update(model=str(source), teacher=str(config.teacher) if config.teacher else None)
    return report
