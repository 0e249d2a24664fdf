"""Perplexity and KL over the block-by-block driver: one decoder block in memory at a time.

Usage::

    from layercut.compress.eval.stream_eval import evaluate_streamed
    result = evaluate_streamed("ckpt-dir", reference="bundled:smollm2-135m", max_tokens=16384)
    result.ppl, result.kl

Same protocol and windows as :func:`layercut.compress.eval.evaluate.evaluate` (README, "Evaluation
protocol"), computed differently: the evaluation windows are the driver's micro-batches,
each block is read from the checkpoint for its turn (:class:`layercut.compress.io.lazy.LazyModel`), and
the final norm and head run on the raw last-block output window by window.

KL without caching distributions: 16k tokens x 128k vocabulary of reference log-probs would
be 8 GB, but the reference's last-block output is only tokens x hidden (16k x 3072 floats =
200 MB for a 3B model). So the reference is streamed first and keeps only that; the
candidate is streamed next; then, window by window, both heads give exact log-probs and
the KL is summed. Nothing is approximated.

Peak memory: one block in the compute dtype, the embedding during input capture, both
heads at the end (in the storage dtype; logits are computed in float32 over vocabulary
slices), and three activation sets of tokens x hidden in float32.

GPTQ checkpoints stream the same way (:class:`~layercut.compress.io.lazy.LazyModel` with
``allow_quantized=True``): a block's turn reads its packed tensors into
:class:`~layercut.compress.quant.format.qlinear.QuantLinear` layers, which run exactly as in the
whole loaded model (:func:`layercut.compress.quant.format.loader.load_quantized`), and frees them after.
The dense tensors of such a checkpoint (embedding, norms, a 16-bit head) are read in their
stored dtype (fp16 by the GPTQ convention) and computed in float32, as the whole model is
under ``--dtype auto``. A quantized head is dequantized a vocabulary slice at a time.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from layercut.calibrate import DEFAULT_EVAL_TEXT
from layercut.calibrate.capture import run_blocks
from layercut.calibrate.sources import TextSource
from layercut.compress.core.errors import LayercutError
from layercut.compress.eval.evaluate import EvalResult, eval_tokens, make_windows, same_length, text_name
from layercut.compress.io.lazy import LazyModel
from layercut.compress.io.models import load_tokenizer, resolve_model, weight_bytes

POSITION_SLICE = 128  # positions whose log-probs are alive at once


class WindowBatches:
    """Fixed micro-batches for the driver (the windows, grouped as the in-memory eval groups them)."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.chunks = chunks  # [B, S] long each; S may differ between chunks (the tail window)

    def split(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(ids, torch.ones_like(ids)) for ids in self.chunks]


def window_chunks(windows: list[tuple[torch.Tensor, int]], batch_size: int) -> list[torch.Tensor]:
    groups = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    return [torch.stack([w for w, _ in chunk]) for group in groups for chunk in same_length(group)]


def last_block_outputs(lazy: LazyModel, batches: WindowBatches, device: str | torch.device | None,
                       progress: bool, desc: str) -> list[torch.Tensor]:
    """Raw last-block output h_L per chunk, [B, S, D] in the compute dtype, streamed block by block."""
    return run_blocks(lazy.model, batches, [], batch_size=1, device=device, progress=progress, desc=desc)


def head_logprobs(lazy: LazyModel, h_last: torch.Tensor) -> torch.Tensor:
    """Log-probs from a raw last-block output: [S, D] -> [S, V] float32 (final norm, head, softcap)."""
    return F.log_softmax(lazy.head_logits(h_last).float(), dim=-1)


@torch.no_grad()
def evaluate_lazy(
    lazy: LazyModel,
    tokenizer,
    text: str | TextSource = DEFAULT_EVAL_TEXT,
    ctx: int = 512,
    max_tokens: int = 16384,
    reference: LazyModel | None = None,
    batch_size: int = 4,
    progress: bool = True,
    device: str | torch.device | None = None,
) -> tuple[EvalResult, float | None]:
    """(figures of ``lazy``, seconds of the reference's own pass or None); see the module docstring.

    ``bytes`` and ``model`` are left for the caller (it knows the paths).
    """
    if ctx < 2 or max_tokens < 2:
        raise LayercutError(f"need ctx >= 2 and max_tokens >= 2 (got {ctx}, {max_tokens})")
    tokens = eval_tokens(tokenizer, text, max_tokens)
    windows = make_windows(tokens, ctx, tokenizer.bos_token_id)
    batches = WindowBatches(window_chunks(windows, batch_size))
    ref_hidden, ref_seconds = None, None
    if reference is not None:
        start = time.perf_counter()
        ref_hidden = last_block_outputs(reference, batches, device, progress, "reference blocks")
        _release_embedding(reference)  # not needed again; the head is read at the end
        ref_seconds = time.perf_counter() - start
    start = time.perf_counter()
    hidden = last_block_outputs(lazy, batches, device, progress, "eval blocks")
    _release_embedding(lazy)
    nll_sum, ref_nll_sum, kl_sum, scored = 0.0, 0.0, 0.0, 0
    for c, ids in enumerate(tqdm(batches.chunks, desc="eval head", unit="batch", disable=not progress)):
        for row in range(ids.shape[0]):
            # positions in slices: a [slice, vocab] float32 tensor is 64 MB at a 128k vocabulary
            for p0 in range(0, ids.shape[1] - 1, POSITION_SLICE):
                p1 = min(p0 + POSITION_SLICE, ids.shape[1] - 1)
                targets = ids[row, p0 + 1 : p1 + 1].unsqueeze(-1)
                logp = head_logprobs(lazy, hidden[c][row, p0:p1].cpu())
                nll_sum -= float(logp.gather(-1, targets).sum())
                scored += targets.numel()
                if reference is not None:
                    ref_logp = head_logprobs(reference, ref_hidden[c][row, p0:p1].cpu())
                    ref_nll_sum -= float(ref_logp.gather(-1, targets).sum())
                    kl_sum += float((ref_logp.exp() * (ref_logp - logp)).sum())
                del logp
    seconds = time.perf_counter() - start
    nll = nll_sum / scored
    result = EvalResult(
        ppl=math.exp(nll), nll=nll, tokens=scored, windows=len(windows), ctx=ctx, params=lazy.num_params,
        bytes=0, seconds=seconds, tokens_per_s=scored / seconds if seconds > 0 else float("nan"),
        kl=kl_sum / scored if reference is not None else None,
        reference_ppl=math.exp(ref_nll_sum / scored) if reference is not None else None, text=text_name(text),
    )
    return result, ref_seconds


def _release_embedding(lazy: LazyModel) -> None:
    emb = lazy.model.get_input_embeddings()
    lazy.release(next(n for n, m in lazy.model.named_modules() if m is emb))


def evaluate_streamed(
    model_spec: str,
    text: str | TextSource = DEFAULT_EVAL_TEXT,
    ctx: int = 512,
    max_tokens: int = 16384,
    reference: str | None = None,
    batch_size: int = 4,
    progress: bool = True,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> EvalResult:
    """:func:`evaluate_lazy` from model specs (paths, ``bundled:NAME``, Hub ids)."""
    path = resolve_model(model_spec)
    tokenizer = load_tokenizer(path, trust_remote_code)
    ref_lazy = None
    if reference is not None:
        ref_path = resolve_model(reference)
        if load_tokenizer(ref_path, trust_remote_code).get_vocab() != tokenizer.get_vocab():
            raise LayercutError("reference model has a different tokenizer vocabulary; KL is undefined")
        ref_lazy = LazyModel(ref_path, dtype, trust_remote_code=trust_remote_code, allow_quantized=True)
    lazy = LazyModel(path, dtype, trust_remote_code=trust_remote_code, allow_quantized=True)
    result, _ = evaluate_lazy(lazy, tokenizer, text, ctx, max_tokens, ref_lazy, batch_size, progress, device)
    result.bytes = weight_bytes(path)
    result.model = str(model_spec) if str(model_spec).startswith("bundled:") else str(path)
    return result
