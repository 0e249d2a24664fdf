"""Held-out evaluation: perplexity, KL to a reference, size and speed.

Usage::

    layercut eval bundled:smollm2-135m --json
    layercut eval OUT_DIR --reference bundled:smollm2-135m --ctx 512 --max-tokens 16384

Protocol (documented in docs/eval.md): the text's documents are joined with blank lines
and tokenized from the start, up to ``max_tokens`` tokens; the tokens are cut into
non-overlapping windows of ``ctx``; each window runs as ``[BOS] + window`` when the
tokenizer has a BOS token and every window token is scored, otherwise the window runs
alone and its first token is not scored. Perplexity is exp of the token-weighted mean
NLL. KL is the mean over the same scored tokens of KL(p_reference ‖ p_model).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from layercut.calibrate import DEFAULT_EVAL_TEXT
from layercut.calibrate.data import load_texts
from layercut.calibrate.sources import TextSource
from layercut.compress.core.arch import count_params
from layercut.compress.core.errors import LayercutError
from layercut.compress.io.models import load_model, resolve_model, weight_bytes


@dataclass
class EvalResult:
    ppl: float
    nll: float
    tokens: int  # scored tokens
    windows: int
    ctx: int
    params: int
    bytes: int
    seconds: float
    tokens_per_s: float
    kl: float | None = None
    reference_ppl: float | None = None
    model: str = ""
    text: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def text_name(text: str | TextSource) -> str:
    """How a report names the evaluation text: the source string."""
    return text if isinstance(text, str) else str(text.source)


def eval_tokens(tokenizer, text: str | TextSource, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` tokens of a text source (documents joined by blank lines); a
    :class:`~layercut.calibrate.sources.TextSource` brings its field / chat-template options."""
    pieces: list[int] = []
    for doc in load_texts(text, tokenizer):
        pieces.extend(tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"])
        if len(pieces) >= max_tokens:
            break
    if len(pieces) < 2:
        raise LayercutError(f"text '{text_name(text)}' has fewer than 2 tokens")
    return torch.tensor(pieces[:max_tokens], dtype=torch.long)


def make_windows(tokens: torch.Tensor, ctx: int, bos: int | None) -> list[tuple[torch.Tensor, int]]:
    """(input ids, index of the first scored position) per window."""
    windows = []
    for start in range(0, tokens.numel(), ctx):
        window = tokens[start : start + ctx]
        if bos is not None:
            windows.append((torch.cat([torch.tensor([bos]), window]), 0))
        elif window.numel() >= 2:
            windows.append((window, 0))
    return windows


@torch.no_grad()
def _window_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs predicting tokens 1.. of each row: ids [B, S] -> [B, S-1, V] float32."""
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), use_cache=False).logits[:, :-1].float()
    return F.log_softmax(logits, dim=-1)


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    text: str | TextSource = DEFAULT_EVAL_TEXT,
    ctx: int = 512,
    max_tokens: int = 16384,
    reference=None,
    batch_size: int = 4,
    progress: bool = True,
) -> EvalResult:
    """Perplexity (and KL to ``reference`` when given) of an in-memory model."""
    if ctx < 2 or max_tokens < 2:
        raise LayercutError(f"need ctx >= 2 and max_tokens >= 2 (got {ctx}, {max_tokens})")
    tokens = eval_tokens(tokenizer, text, max_tokens)
    windows = make_windows(tokens, ctx, tokenizer.bos_token_id)
    nll_sum, kl_sum, ref_nll_sum, scored, seconds = 0.0, 0.0, 0.0, 0, 0.0
    groups = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    for group in tqdm(groups, desc="eval", unit="batch", disable=not progress):
        # Same-length windows batch together; the short tail window runs alone.
        for chunk in same_length(group):
            ids = torch.stack([w for w, _ in chunk])
            targets = ids[:, 1:]
            start = time.perf_counter()
            logp = _window_logprobs(model, ids)
            seconds += time.perf_counter() - start
            tok_logp = logp.gather(-1, targets.to(logp.device).unsqueeze(-1)).squeeze(-1)
            nll_sum -= float(tok_logp.sum())
            scored += targets.numel()
            if reference is not None:
                ref_logp = _window_logprobs(reference, ids).to(logp.device)
                ref_nll_sum -= float(ref_logp.gather(-1, targets.to(logp.device).unsqueeze(-1)).sum())
                kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
                kl_sum += float(kl.sum())
            del logp
    nll = nll_sum / scored
    return EvalResult(
        ppl=math.exp(nll),
        nll=nll,
        tokens=scored,
        windows=len(windows),
        ctx=ctx,
        params=count_params(model),
        bytes=0,
        seconds=seconds,
        tokens_per_s=scored / seconds if seconds > 0 else float("nan"),
        kl=kl_sum / scored if reference is not None else None,
        reference_ppl=math.exp(ref_nll_sum / scored) if reference is not None else None,
        text=text_name(text),
    )


def same_length(group: list[tuple[torch.Tensor, int]]) -> list[list[tuple[torch.Tensor, int]]]:
    chunks: dict[int, list] = {}
    for item in group:
        chunks.setdefault(item[0].numel(), []).append(item)
    return list(chunks.values())


def evaluate_path(
    model_spec: str,
    text: str | TextSource = DEFAULT_EVAL_TEXT,
    ctx: int = 512,
    max_tokens: int = 16384,
    reference: str | None = None,
    batch_size: int = 4,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> EvalResult:
    """Load ``model_spec`` (and ``reference``) and evaluate; fills in bytes on disk."""
    path = resolve_model(model_spec)
    model, tokenizer = load_model(path, trust_remote_code=trust_remote_code)
    ref_model = None
    if reference is not None:
        ref_model, ref_tok = load_model(reference, trust_remote_code=trust_remote_code)
        if ref_tok.get_vocab() != tokenizer.get_vocab():
            raise LayercutError("reference model has a different tokenizer vocabulary; KL is undefined")
    result = evaluate(model, tokenizer, text, ctx, max_tokens, ref_model, batch_size, progress)
    result.bytes = weight_bytes(path)
    result.model = str(model_spec) if str(model_spec).startswith("bundled:") else str(Path(path))
    return result
