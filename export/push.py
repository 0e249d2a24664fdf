"""Publish an exported checkpoint to the Hugging Face Hub.

Usage::

    layercut push runs/demo --repo-id my-org/smollm2-demo --dry-run     # list exactly what would go up
    layercut push runs/demo --repo-id my-org/smollm2-demo --private --revision v1

    from layercut.export.push import push
    push("runs/demo/05-export/model", "my-org/smollm2-demo", dry_run=True)

Uses ``huggingface_hub`` only (``create_repo``, ``create_branch`` for a non-default
revision, one ``create_commit`` of exactly the listed files). A layercut model card is
uploaded with its usage snippet loading the repo id (and revision) instead of the local
folder (:func:`pushed_card`); the local README.md is left as it is. The token comes from
the standard places (``HF_TOKEN``, the token file written by ``hf auth login``, ...) via
``huggingface_hub.get_token``; layercut never prints, logs or writes it, and scrubs it from
any error message it reports. ``HF_ENDPOINT`` selects another Hub (used by the tests).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layercut.compress.core.errors import LayercutError
from layercut.export.card_usage import folder_kind, set_usage

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(rf"^{_NAME}/{_NAME}$")
REVISION = re.compile(r"^(?!/)(?!.*//)(?!.*\.\.)(?!.*\.lock$)[A-Za-z0-9._/-]{1,200}(?<!/)$")


@dataclass
class PushPlan:
    folder: str
    repo_id: str
    revision: str | None
    private: bool
    files: list[str]
    bytes: int
    dry_run: bool = True
    commit_url: str | None = None
    repo_url: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("extra")
        return {**data, **self.extra}


def check_repo_id(repo_id: str) -> str:
    """``ORG/NAME``: letters, digits, ``-``, ``_``, ``.``; no ``--``/``..``; name ≤ 96 chars."""
    if not REPO_ID.match(repo_id or "") or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        raise LayercutError(
            f"invalid repo id '{repo_id}': expected ORG/NAME (letters, digits, '-', '_', '.'; "
            "no '--' or '..'; at most 96 characters per part)"
        )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise LayercutError(f"invalid repo id '{repo_id}': {str(exc).splitlines()[0]}") from None
    return repo_id


def resolve_folder(path: str | os.PathLike) -> Path:
    """A checkpoint directory to upload; a layercut run directory resolves to its final model."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise LayercutError(f"nothing to push: {p} is not a directory")
    report = p / "report.json"
    if (p / "recipe.yaml").is_file() and report.is_file() and not (p / "config.json").is_file():
        try:
            final = json.loads(report.read_text()).get("final_model")
        except json.JSONDecodeError as exc:
            raise LayercutError(f"{report}: invalid JSON ({exc.msg})") from None
        if not final:
            raise LayercutError(f"{p}: the run has not produced a model yet")
        p = p / final
    if not (p / "config.json").is_file():
        raise LayercutError(f"{p} is not a model checkpoint (no config.json); push an exported folder")
    if not any(p.glob("*.safetensors")):
        raise LayercutError(f"{p} has no .safetensors weights; export it first (layercut export)")
    return p


def upload_list(folder: Path) -> list[str]:
    """Every regular file under ``folder``, relative and sorted; hidden files and folders are skipped."""
    files = []
    for item in sorted(folder.rglob("*")):
        rel = item.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not item.is_file() or item.is_symlink():
            continue
        files.append(rel.as_posix())
    return files


def pushed_card(folder: Path, repo_id: str, revision: str | None = None) -> bytes | None:
    """README.md as uploaded, if it differs from the local one: a layercut card (one marked usage
    block) gets the snippet for the folder's checkpoint kind, loading ``repo_id``; else None."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    local = readme.read_text(encoding="utf-8", errors="replace")
    text = set_usage(local, folder_kind(folder) or "dense", repo_id, None if revision in (None, "main") else revision)
    return None if text is None or text == local else text.encode()


def _scrub(text: str, token: str | None) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else "unknown error"
    return line.replace(token, "***") if token else line


def push(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    commit_message: str = "Upload compressed model (layercut)",
) -> PushPlan:
    """Create the repo if needed and upload exactly :func:`upload_list` of the folder."""
    check_repo_id(repo_id)
    if revision is not None and not REVISION.match(revision):
        raise LayercutError(f"invalid revision '{revision}': use a branch name like v1 or release/2025-01")
    path = resolve_folder(folder)
    files = upload_list(path)
    size = sum((path / f).stat().st_size for f in files)
    card = pushed_card(path, repo_id, revision) if "README.md" in files else None
    plan = PushPlan(str(path), repo_id, revision, private, files, size, dry_run=dry_run)
    if card is not None:
        plan.bytes += len(card) - (path / "README.md").stat().st_size
        plan.extra["card"] = f"README.md: usage snippet set to load {repo_id}"
    if dry_run:
        return plan
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise LayercutError("HF_HUB_OFFLINE is set: unset it to push (or use --dry-run)")
    from huggingface_hub import CommitOperationAdd, HfApi, get_token

    token = get_token()
    if not token:
        raise LayercutError("no Hugging Face token found: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        operations = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=card if f == "README.md" and card
                                         else str(path / f)) for f in files]
        info = api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message,
                                 revision=revision, repo_type="model")
    except LayercutError:
        raise
    except Exception as exc:  # huggingface_hub raises HTTP, validation and OS errors
        raise LayercutError(f"push to {repo_id} failed: {_scrub(str(exc), token)}") from None
    plan.repo_url = str(url)
    plan.commit_url = getattr(info, "commit_url", None)
    return plan
