"""The one block-by-block capture driver every data-driven stage runs on.

Usage::

    from layercut.calibrate.capture import run_blocks

    def on_block(run):                      # called once per decoder block, in order
        h_in = run.inputs                   # [B, L, D] per micro-batch: residual stream h_l
        h_out = run.outputs()               # h_{l+1}, computed once and cached
        run.forward(hooks={"mlp.down_proj": lambda i, x, y: ...})   # extra pass with hooks
        # A stage may change run.block here (e.g. quantize it) and call run.invalidate():
        # the driver then recomputes the outputs that the next block sees.

    h_last = run_blocks(model, calib, [on_block])   # raw output of the last block (h_L)

How it works: one forward of the *base* model with every decoder block swapped for a
pass-through recorder captures the stream entering block 0 and, for every block, the
keyword arguments the model gives it (masks, rotary embeddings — which differ per layer
in Gemma-style models). No exception stops a forward pass. Then each block runs over the
calibration micro-batches, stages see its inputs/outputs through callbacks and hooks,
and the outputs become the next block's inputs. Peak memory is one block + two sets of
activations (inputs and outputs) + whatever accumulators the stages keep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import ArchSpec, arch_for, get_submodule
from layercut.compress.core.devices import current_device
from layercut.compress.io.lazy import lazy_of

HookFn = Callable[[int, torch.Tensor, torch.Tensor], None]  # (batch_index, module_input, module_output)


def first_tensor(value: Any) -> torch.Tensor:
    """Modules return a tensor or a tuple whose first item is the tensor (attention)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def _rows(value: Any, n: int, rows: torch.Tensor) -> Any:
    """``value`` with every tensor whose first dimension is ``n`` (the batch) indexed by ``rows``."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() and value.shape[0] == n else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, n, rows) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, n, rows) for k, v in value.items()}
    return value


class _Recorder(nn.Module):
    """Stands in for a decoder block during input capture: records, returns input unchanged."""

    def __init__(self, index: int, sink: list[list[tuple[tuple, dict]]], first: list[torch.Tensor]):
        super().__init__()
        self.index, self.sink, self.first = index, sink, first

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.index == 0:
            self.first.append(hidden_states.detach())
        kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "layer_past")}
        kwargs["use_cache"] = False
        self.sink[self.index].append((args, kwargs))
        return hidden_states


@dataclass
class BlockRun:
    """One decoder block's turn in the driver. Lists are indexed by micro-batch."""

    index: int
    block: nn.Module
    spec: ArchSpec
    inputs: list[torch.Tensor]  # h_l: [B, L, D]
    masks: list[torch.Tensor]  # [B, L] bool, True on real tokens
    call_args: list[tuple[tuple, dict]]  # extra positional / keyword args per micro-batch
    num_blocks: int
    _outputs: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_blocks - 1

    def call(self, i: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output on micro-batch i, or on its sequences ``rows`` (an index tensor), with no
        hooks and nothing cached; runs under the caller's grad mode.

        With ``rows``, the call arguments whose first dimension is the batch (attention masks; rotary
        tables when they are per sequence) are sliced too. A micro-batch whose size equals its length
        cannot tell the batch dimension apart, so it is never sliced (its whole output is returned)."""
        args, kwargs = self.call_args[i]
        x = self.inputs[i]
        if rows is not None and self.sliceable(i):
            n = x.shape[0]
            x, args, kwargs = x[rows], _rows(args, n, rows), _rows(kwargs, n, rows)
        return first_tensor(self.block(x, *args, **kwargs))

    def sliceable(self, i: int) -> bool:
        """Whether :meth:`call` can run a subset of micro-batch i's sequences."""
        n, length = self.inputs[i].shape[:2]
        return n > 1 and n != length

    @torch.no_grad()
    def forward(self, hooks: dict[str, HookFn] | None = None,
                after_each: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Run the block over every micro-batch with forward hooks on named submodules.

        ``hooks`` maps a dotted path inside the block (e.g. ``"mlp.down_proj"``) to
        ``fn(batch_index, module_input, module_output)``. ``after_each(batch_index)`` runs once
        each micro-batch's pass (and its hooks) is done. Returns the block outputs.
        """
        current = {"i": 0}
        handles = []
        for path, fn in (hooks or {}).items():
            module = get_submodule(self.block, path)

            def hook(_mod, inp, out, fn=fn):
                fn(current["i"], first_tensor(inp) if inp else None, first_tensor(out))

            handles.append(module.register_forward_hook(hook))
        try:
            outs = []
            for i in range(len(self.inputs)):
                current["i"] = i
                outs.append(self.call(i))
                if after_each is not None:
                    after_each(i)
        finally:
            for h in handles:
                h.remove()
        self._outputs = outs
        return outs

    def outputs(self) -> list[torch.Tensor]:
        """h_{l+1} per micro-batch, computed once (again after :meth:`invalidate`)."""
        if self._outputs is None:
            self.forward()
        return self._outputs

    def invalidate(self) -> None:
        """Call after changing the block's weights so its outputs are recomputed."""
        self._outputs = None

    def sublayer_outputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(attention contribution, MLP contribution, block output) per micro-batch.

        The contributions are what each sublayer adds to the residual stream, so the
        stream entering the MLP is ``inputs[i] + attn[i]`` (sequential residual).
        """
        attn: list[torch.Tensor] = []
        mlp: list[torch.Tensor] = []
        outs = self.forward(
            hooks={
                self.spec.attn_out: lambda i, x, y: attn.append(y),
                self.spec.mlp_out: lambda i, x, y: mlp.append(y),
            }
        )
        return attn, mlp, outs

    def flat_mask(self, i: int) -> torch.Tensor:
        return self.masks[i].reshape(-1)


@torch.no_grad()
def capture_inputs(
    model: nn.Module, calib: CalibSet, batch_size: int = 8, spec: ArchSpec | None = None
) -> tuple[list[torch.Tensor], list[list[tuple[tuple, dict]]]]:
    """Stream entering block 0 and each block's call arguments, per micro-batch."""
    spec = spec or arch_for(model)
    base = spec.base_of(model)
    layers = spec.layers_of(model)
    lazy = lazy_of(model)
    if lazy is not None:  # the base model without its blocks: embeddings, final norm
        lazy.prepare_capture()
    originals = list(layers)
    sink: list[list[tuple[tuple, dict]]] = [[] for _ in originals]
    first: list[torch.Tensor] = []
    device = model.get_input_embeddings().weight.device
    try:
        for i in range(len(originals)):
            layers[i] = _Recorder(i, sink, first)
        for ids, mask in calib.split(batch_size):
            base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    finally:
        for i, block in enumerate(originals):
            layers[i] = block
    return first, sink


def _put_back(block: nn.Module, index: int, lazy: Any, device: torch.device, home: torch.device) -> None:
    """End a block's turn: a streamed block is released, a resident one moved back home."""
    if lazy is not None:
        lazy.release(lazy.block_path(index))
    elif device != home:
        block.to(home)


@torch.no_grad()
def run_blocks(
    model: nn.Module,
    calib: CalibSet,
    callbacks: Iterable[Callable[[BlockRun], None]],
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "blocks",
    last: int | None = None,
) -> list[torch.Tensor]:
    """Run ``callbacks`` on every decoder block in order; return the raw last-block output h_L.

    ``last``: stop after that block (none: run them all); what is returned is then its output,
    not h_L. For callbacks that need nothing past it (fitting maps over spans that end there).

    ``device``: where each block runs (moved there for its turn and back). Defaults to
    the model's device. Activations stay on that device.

    A :class:`layercut.compress.io.lazy.LazyModel`'s model is streamed: each block is read from the
    checkpoint for its turn and released after the callbacks, so changes a callback makes to
    a block must be saved within its turn.
    """
    spec = arch_for(model)
    layers = spec.layers_of(model)
    callbacks = list(callbacks)
    lazy = lazy_of(model)  # a streamed model's blocks are read onto the CPU for their turn
    home = torch.device("cpu") if lazy is not None else model.get_input_embeddings().weight.device
    if device is None:  # a stage's --device (layercut.compress.core.devices.compute_device), else where the model is
        device = current_device() or home
    device = torch.device(device)
    hidden, call_args = capture_inputs(model, calib, batch_size, spec)
    if lazy is not None:  # the embedding (128k x hidden on Llama 3) is not needed past input capture
        lazy.release_outside()
    masks = [m.bool().to(device) for _, m in calib.split(batch_size)]
    hidden = [h.to(device) for h in hidden]
    stop = len(layers) if last is None else min(last + 1, len(layers))
    bar = tqdm(range(stop), desc=desc, disable=not progress, unit="block")
    for index in bar:
        block = lazy.block(index) if lazy is not None else layers[index]
        if device != home:
            block.to(device)
        run = BlockRun(
            index=index,
            block=block,
            spec=spec,
            inputs=hidden,
            masks=masks,
            call_args=[to_device(a, device) for a in call_args[index]],
            num_blocks=len(layers),
        )
        try:
            for callback in callbacks:
                callback(run)
            hidden = run.outputs()
        except BaseException:  # the block still goes home (or is released); the callback's error is raised
            with contextlib.suppress(Exception):
                _put_back(block, index, lazy, device, home)
            raise
        _put_back(block, index, lazy, device, home)
        call_args[index] = []  # free this block's masks / rotary tensors early
    return hidden
