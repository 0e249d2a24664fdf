"""Write checkpoint directories atomically: temp folder first, rename when complete.

Usage::

    from layercut.compress.core.save import atomic_dir, save_checkpoint
    save_checkpoint(model, tokenizer, "out/pruned")        # sharded safetensors + index

    with atomic_dir("out/thing") as tmp:                    # anything else, same guarantee
        (tmp / "plan.json").write_text("{}")

A half-written output never appears under the final name: the directory is built as a
hidden sibling ``.name.tmp-XXXX`` and moved into place with ``os.replace`` once every
file is written. An existing target is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from layercut.compress.core.errors import LayercutError


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Validate an output location before any work is done."""
    target = Path(path).expanduser()
    if target.exists() and not overwrite:
        raise LayercutError(f"output {target} already exists (remove it, or pass --overwrite / --resume)")
    parent = target.parent if str(target.parent) else Path(".")
    parent_exists = parent.exists()
    probe_dir = parent if parent_exists else next((p for p in parent.parents if p.exists()), Path("."))
    if not os.access(probe_dir, os.W_OK):
        raise LayercutError(f"output location {probe_dir} is not writable")
    if parent_exists and not parent.is_dir():
        raise LayercutError(f"output parent {parent} is not a directory")
    return target


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only if the block succeeds."""
    target = check_output_dir(path, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for file in root.rglob("*"):
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())


def save_checkpoint(
    model,
    tokenizer,
    path: str | os.PathLike,
    max_shard_size: str = "2GB",
    overwrite: bool = False,
    extra_files: dict[str, str | bytes] | None = None,
) -> Path:
    """``save_pretrained`` (safetensors, sharded with an index, metadata format=pt) + tokenizer.

    ``extra_files`` maps file names to contents written beside the weights.
    """
    with atomic_dir(path, overwrite) as tmp:
        write_checkpoint_into(model, tokenizer, tmp, max_shard_size, extra_files)
    return Path(path)


def write_checkpoint_into(
    model,
    tokenizer,
    folder: Path,
    max_shard_size: str = "2GB",
    extra_files: dict[str, str | bytes] | None = None,
) -> None:
    """The non-atomic part of :func:`save_checkpoint`, for callers that own the temp dir."""
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for name, content in (extra_files or {}).items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(folder / name, mode) as fh:
            fh.write(content)
