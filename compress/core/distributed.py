"""Data parallelism under ``torchrun``: the process group, the calibration split, agreement checks.

Usage::

    torchrun --nproc-per-node 2 -m layercut quantize MODEL -o OUT --bits 4

    from layercut.compress.core.distributed import process_group, world_from_env
    with process_group(torch.device("cpu")) as group:   # None outside torchrun (WORLD_SIZE unset or 1)
        group.check_agree("quantize", {"model": str(path), "calibration tokens": digest})
        rows = group.shard_rows(num_samples, batch_size)    # this process's micro-batches r, r+W, ...
        parts = group.all_gather(tensor)                    # one tensor per rank, in rank order

The mode comes from torchrun's environment (``WORLD_SIZE`` > 1, ``RANK``, ``LOCAL_RANK``); the
group is gloo on the CPU and nccl on CUDA (each process on ``cuda:LOCAL_RANK``). Errors that
every process raises alike (a refused option, a disagreement) are printed by rank 0 only:
:func:`same_on_every_rank` marks them quiet on the other ranks, and the CLI skips quiet errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layercut.compress.core.errors import LayercutError

__all__ = ["Group", "is_secondary", "process_group", "same_on_every_rank", "tensor_digest", "world_from_env"]


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 1, 0
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def is_secondary() -> bool:
    """True in a torchrun process other than rank 0 (it prints no report and no shared error)."""
    rank, world, _ = world_from_env()
    return world > 1 and rank != 0


@contextlib.contextmanager
def same_on_every_rank() -> Iterator[None]:
    """A :class:`LayercutError` raised inside is the same on every process: only rank 0 prints it."""
    try:
        yield
    except LayercutError as exc:
        exc.shared = True  # type: ignore[attr-defined]  # process_group: every rank stops here together
        if is_secondary():
            exc.quiet = True  # type: ignore[attr-defined]  # the CLI exits with its code, silently
        raise


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' dtypes, shapes and bytes (CPU copies)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass(frozen=True)
class Group:
    """This process's place in the default process group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device  # where collectives' tensors live (cpu for gloo, cuda:LOCAL_RANK for nccl)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` (same shape and dtype on every rank) from every rank, in rank order."""
        tensor = tensor.to(self.device).contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(out, tensor)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def check_agree(self, what: str, values: Mapping[str, str]) -> None:
        """Refuse (every rank, one line printed by rank 0) unless all ranks hold the same ``values``."""
        mine = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in values.items()}
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        for key in values:  # every rank sees the same list, so every rank raises the same error
            differ = [r for r, d in enumerate(everyone) if d[key] != everyone[0][key]]
            if differ:
                with same_on_every_rank():
                    raise LayercutError(
                        f"{what}: the {self.world} torchrun processes disagree on the {key} (rank "
                        f"{', '.join(map(str, differ))} differs from rank 0); every process must see the same "
                        "model, options and text")

    def micro_batches(self, total: int) -> range:
        """This rank's micro-batches of ``total``: r, r + W, r + 2W, ..."""
        return range(self.rank, total, self.world)

    def rounds(self, total: int) -> int:
        """Rounds of one micro-batch per rank that cover ``total`` micro-batches (rank 0 has this many)."""
        return math.ceil(total / self.world)

    def shard_rows(self, num_samples: int, batch_size: int) -> torch.Tensor:
        """Row indices of this rank's sequences: its micro-batches of ``batch_size`` consecutive rows,
        dealt round-robin, so each is exactly the micro-batch a single process would run."""
        total = math.ceil(num_samples / batch_size)
        if total < self.world:
            raise LayercutError(f"{total} micro-batch(es) of {batch_size} sequences cannot be shared by "
                                f"{self.world} processes: raise --samples or lower --batch-size")
        return torch.cat([torch.arange(k * batch_size, min((k + 1) * batch_size, num_samples))
                          for k in self.micro_batches(total)])


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[Group | None]:
    """The default process group for the enclosed work under torchrun, destroyed afterwards;
    None (and nothing initialized) outside torchrun. ``device``: the compute device."""
    rank, world, local_rank = world_from_env()
    if world <= 1:
        yield None
        return
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)  # env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    try:
        yield Group(rank=rank, world=world, local_rank=local_rank, device=device)
    except LayercutError as exc:
        if getattr(exc, "shared", False):  # raised alike everywhere: leave together (no rank exits mid-teardown)
            dist.barrier()
        raise
    finally:
        dist.destroy_process_group()
