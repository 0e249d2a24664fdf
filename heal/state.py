"""Training-state checkpoints for ``--checkpoint-every K`` / ``--resume``: no pickles.

Usage::

    from layercut.heal.state import save_state, load_state, latest_state
    save_state(state_dir, step, peft_model, optimizer, losses, cfg)   # state_dir/step-000050/
    step, losses = load_state(latest_state(state_dir), peft_model, optimizer, cfg)

A checkpoint is one directory written atomically (``layercut.compress.core.save.atomic_dir``):
``adapter.safetensors`` (peft's adapter state dict), ``optimizer.safetensors`` + the
optimizer's JSON-able parts in ``state.json`` (step, losses, config fingerprint), and
``rng.safetensors`` (the torch CPU/CUDA generator states). Only the newest is kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir
from layercut.heal.config import HealConfig

STEP_PREFIX = "step-"


def default_state_dir(out_dir: str | Path) -> Path:
    """Where a run writing ``OUT`` keeps its training state: the sibling ``OUT.heal-state``."""
    out = Path(out_dir).expanduser()
    return out.parent / f"{out.name}.heal-state"


def latest_state(state_dir: str | Path | None) -> Path | None:
    """The newest complete checkpoint directory under ``state_dir`` (None if there is none)."""
    if state_dir is None or not Path(state_dir).is_dir():
        return None
    steps = sorted(p for p in Path(state_dir).iterdir()
                   if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / "state.json").is_file())
    return steps[-1] if steps else None


def _optimizer_tensors(opt_state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for pid, per_param in opt_state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, scalars


def save_state(state_dir: str | Path, step: int, peft_model, optimizer: torch.optim.Optimizer,
               losses: list[float], cfg: HealConfig) -> Path:
    """Write ``state_dir/step-{step:06d}`` atomically, then drop older checkpoints."""
    from peft.utils import get_peft_model_state_dict

    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    target = state_dir / f"{STEP_PREFIX}{step:06d}"
    adapter = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
    opt_state = optimizer.state_dict()
    opt_tensors, opt_scalars = _optimizer_tensors(opt_state)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    meta = {"step": step, "losses": losses, "config": cfg.fingerprint(),
            "optimizer": {"param_groups": opt_state["param_groups"], "scalars": opt_scalars}}
    with atomic_dir(target, overwrite=True) as tmp:
        save_file(adapter, str(tmp / "adapter.safetensors"), metadata={"format": "pt"})
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"), metadata={"format": "pt"})
        save_file(rng, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    for old in state_dir.iterdir():
        if old.is_dir() and old.name.startswith(STEP_PREFIX) and old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LayercutError(f"{path}: unreadable heal checkpoint ({exc})") from exc


def check_compatible(meta: dict[str, Any], cfg: HealConfig, path: Path) -> None:
    saved, now = meta.get("config", {}), cfg.fingerprint()
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        parts = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff)
        raise LayercutError(f"cannot resume from {path}: settings differ ({parts})")


def load_state(path: Path, peft_model, optimizer: torch.optim.Optimizer, cfg: HealConfig
               ) -> tuple[int, list[float], dict[str, torch.Tensor]]:
    """Restore adapter and optimizer in place; return (step, losses, rng states)."""
    from peft.utils import set_peft_model_state_dict

    meta = read_meta(path)
    check_compatible(meta, cfg, path)
    try:
        adapter = load_file(str(path / "adapter.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
        rng = load_file(str(path / "rng.safetensors"))
    except Exception as exc:  # safetensors raises several types on a damaged file
        raise LayercutError(f"{path}: damaged heal checkpoint ({exc})") from exc
    result = set_peft_model_state_dict(peft_model, adapter)
    if getattr(result, "unexpected_keys", None):
        raise LayercutError(f"{path}: adapter does not fit this model ({result.unexpected_keys[:3]} ...)")
    state: dict[int, dict[str, Any]] = {}
    for key, value in opt_tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    for key, value in meta["optimizer"]["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    try:
        optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})
    except (ValueError, KeyError) as exc:
        raise LayercutError(f"{path}: optimizer state does not fit ({exc})") from exc
    return int(meta["step"]), [float(x) for x in meta["losses"]], rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["cpu"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
