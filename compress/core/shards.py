"""Write safetensors shards as tensors arrive, with the standard index, never the whole model.

Usage::

    from layercut.compress.core.shards import ShardWriter
    with ShardWriter(folder, max_shard_bytes=2 * 2**30) as writer:
        for name, tensor in tensors():          # one tensor (or one block) at a time
            writer.add(name, tensor)
    # folder/model.safetensors                 (one shard), or
    # folder/model-00001-of-00003.safetensors … + model.safetensors.index.json

Every tensor is written to disk as it arrives (resident memory: one tensor); a shard is
closed as soon as adding the next tensor would pass ``max_shard_bytes``. Shards are written under
provisional names and renamed to the ``-0000i-of-0000n`` form when the writer closes,
because the count is known only then. ``folder`` is expected to be a temporary directory
that the caller moves into place when everything is written (see
:func:`layercut.compress.core.save.atomic_dir`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from layercut.compress.core.dtypes import SAFETENSORS_CODES
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.units import parse_size

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_index(folder: str | os.PathLike) -> dict[str, str] | None:
    """Tensor name -> shard file name from ``folder``'s safetensors index; None without an index.

    The one reader of ``model.safetensors.index.json``; a file that is not an index is one
    clear LayercutError.
    """
    index = Path(folder) / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a mapping")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise LayercutError(f"{index}: not a safetensors index (no weight_map)") from exc
    return dict(weight_map)


def weight_map(folder: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> safetensors file name in ``folder``: the index when sharded, else every
    file's header. LayercutError when there are no weights or a header is corrupt."""
    folder = Path(folder)
    indexed = read_index(folder)
    if indexed is not None:
        return indexed
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LayercutError(f"{folder}: no .safetensors weights")
    out: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                out.update((k, file.name) for k in fh.keys())
        except Exception as exc:  # safetensors raises its own error types
            raise LayercutError(f"{file}: corrupt safetensors file ({exc})") from exc
    return out


_ST_NAMES = {getattr(torch, name): code for name, code in SAFETENSORS_CODES.items()}
# safetensors' own order inside a file (save_file): dtypes in the table's order, then names; add_shard follows it
_ST_ORDER = {getattr(torch, name): i for i, name in enumerate(SAFETENSORS_CODES)}
COPY_CHUNK = 64 * 2**20


class ShardWriter:
    """Incremental safetensors shard writer; see the module docstring.

    Each tensor's bytes go to disk as soon as it is added (a data file beside the shard), so
    resident memory is one tensor, not one shard; when a shard is full its header is written
    and the data appended to it in 64 MiB chunks (the safetensors format puts every offset
    in a header before the data, so a shard's header can only be written once it is known).
    """

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int | str = "2GB",
                 metadata: dict[str, str] | None = None, always_index: bool = False) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = parse_size(max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._entries: dict[str, dict] = {}  # this shard's header entries, in order
        self._data = None  # open data file of the current shard
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # provisional file name, tensor names
        self._names: set[str] = set()
        self.total_bytes = 0
        self.always_index = always_index  # model-00001-of-00001 + index even for one shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes under ``name``; starts a new shard first if it would overflow."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        if tensor.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors")
        if self._entries and self._pending_bytes + tensor.numel() * tensor.element_size() > self.max_bytes:
            self.flush()
        self._add(name, tensor)

    def add_shard(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` as one shard of their own, laid out as safetensors' ``save_file`` lays
        out a file (by dtype, then by name), so the shard is byte for byte the file it would write."""
        self.flush()
        for name in sorted(tensors, key=lambda n: (_ST_ORDER.get(tensors[n].dtype, len(_ST_ORDER)), n)):
            self._add(name, tensors[name])
        self.flush()

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        if tensor.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors")
        size = tensor.numel() * tensor.element_size()
        if self._data is None:
            self._data = open(self.folder / f".shard-{len(self._shards):05d}.data", "wb")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if size:
            self._data.write(memoryview(flat.view(torch.uint8).numpy()))
        self._entries[name] = {"dtype": _ST_NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [self._pending_bytes, self._pending_bytes + size]}
        self._pending_bytes += size
        self._names.add(name)
        self.total_bytes += size

    def flush(self) -> None:
        """Close the current shard: header first, then its data, copied in chunks."""
        if not self._entries:
            return
        data_path = Path(self._data.name)
        self._data.close()
        header = json.dumps({"__metadata__": self.metadata, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # 8-byte alignment of the data, as safetensors writes it
        provisional = f".shard-{len(self._shards):05d}.safetensors"
        with open(self.folder / provisional, "wb") as out, open(data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            while chunk := data.read(COPY_CHUNK):
                out.write(chunk)
        data_path.unlink()
        self._shards.append((provisional, list(self._entries)))
        self._entries, self._data, self._pending_bytes = {}, None, 0

    def close(self) -> list[Path]:
        """Flush, give the shards their final names, write the index if there are several."""
        self.flush()
        if not self._shards:
            raise ValueError("no tensors were written")
        count = len(self._shards)
        if count == 1 and not self.always_index:
            os.replace(self.folder / self._shards[0][0], self.folder / SINGLE)
            return [self.folder / SINGLE]
        weight_map: dict[str, str] = {}
        paths = []
        for i, (provisional, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / provisional, self.folder / final)
            weight_map.update({name: final for name in names})
            paths.append(self.folder / final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return paths

    def abort(self) -> None:
        """Stop without finishing: close the open data file (the caller deletes the folder)."""
        if self._data is not None:
            self._data.close()
            self._data = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
