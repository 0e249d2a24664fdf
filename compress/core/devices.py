"""Where blocks run: the ``--device`` option of every data stage.

Usage::

    from layercut.compress.core.devices import on_device, compute_device, current_device
    with compute_device("auto"):            # cuda when available, else cpu
        run_blocks(model, calib, callbacks)  # each block is moved there for its turn

    @on_device                               # a stage's run(config, ...): config.device for its duration
    def run(config, source, output=None, env=None): ...

The model itself stays where it was loaded (the CPU, or on disk for a streamed model): the
capture driver (:func:`layercut.calibrate.capture.run_blocks`) moves each block and its activations to
the compute device for the block's turn and back, so GPU memory holds one block at a time.
``auto`` is cuda when ``torch.cuda.is_available()``, else cpu; asking for ``cuda`` on a
machine without one is one clear error, before any work.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from layercut.compress.core.errors import LayercutError

if TYPE_CHECKING:
    import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
DEVICE_HELP = ("where each block runs: auto (cuda when available, else cpu), cpu, cuda or cuda:N; the "
               "model's weights stay on the CPU or on disk and one block at a time moves there")

_CURRENT: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("layercut_device", default=None)
F = TypeVar("F", bound=Callable[..., Any])


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` → cuda if available else cpu; ``cuda[:N]`` checked against the machine."""
    import torch

    if isinstance(name, torch.device):
        name = str(name)
    if not re.match(DEVICE_PATTERN, name):
        raise LayercutError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LayercutError(f"--device {name}: no CUDA device on this machine (torch.cuda.is_available() is "
                                f"False; torch {torch.__version__}); use --device cpu or auto")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise LayercutError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


@contextmanager
def compute_device(name: str | torch.device) -> Iterator[torch.device]:
    """Run the enclosed block passes on ``name`` (resolved, checked); yields the device."""
    device = resolve_device(name)
    token = _CURRENT.set(device)
    try:
        yield device
    finally:
        _CURRENT.reset(token)


def current_device() -> torch.device | None:
    """The device set by the innermost :func:`compute_device`, or None (then: the model's own)."""
    return _CURRENT.get()


def on_device(run: F) -> F:
    """Decorate a stage's ``run(config, ...)``: ``config.device`` is the compute device meanwhile."""

    @functools.wraps(run)
    def wrapper(config: Any, *args: Any, **kwargs: Any) -> Any:
        with compute_device(getattr(config, "device", "auto")):
            return run(config, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
