"""The card's "Use" section: a loading snippet that is correct for what the checkpoint holds.

Usage::

    from layercut.export.card_usage import folder_kind, usage_block, set_usage
    block = usage_block(folder_kind("release/"), "/abs/path/release")   # before a push: the folder
    text = set_usage(readme_text, folder_kind("release/"), "org/name", revision="v1")  # after one

Three kinds (snippets in ``export/templates/usage-*.md``):

- ``dense``: safetensors weights, stock ``AutoModelForCausalLM.from_pretrained``;
- ``gptq``: GPTQ with one bit width; stock transformers loads it through optimum + gptqmodel;
- ``gptq-mixed``: GPTQ with per-layer ``dynamic`` overrides, which GPTQModel applies (tested) and vLLM documents (untested here).

The block sits between two HTML comments, so ``layercut push`` can replace the local path
with the repo id in the card it uploads (:func:`set_usage`) without re-deriving the card.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from string import Template

KINDS = ("dense", "gptq", "gptq-mixed")
START, END = "<!-- layercut:usage -->", "<!-- /layercut:usage -->"
_BLOCK = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
TEMPLATES = Path(__file__).resolve().parent / "templates"


def folder_kind(folder: str | os.PathLike) -> str | None:
    """The kind of the checkpoint in ``folder`` from its ``config.json``; None without one."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not quant:
        return "dense"
    # a quantized head (lm_head: true) is not read by stock transformers: it loads a random one
    return "gptq-mixed" if quant.get("dynamic") or quant.get("lm_head") else "gptq"


def report_kind(quantize: dict | None, export: dict | None) -> str:
    """The kind from the run's reports: GPTQ-packed unless no quantize stage ran or export dequantized."""
    packed = bool(export.get("quantized")) and not export.get("dequantized") if export is not None \
        else quantize is not None
    if not packed:
        return "dense"
    return "gptq-mixed" if len(set(bit_values(quantize or {}))) > 1 else "gptq"


def bit_values(quant: dict) -> list:
    """Every bit width in a quantize report (per layer, or per layer and module)."""
    bits = quant.get("bits_per_layer") or {}
    values = list(bits.values()) if isinstance(bits, dict) else list(bits)
    flat = [v for x in values for v in (x.values() if isinstance(x, dict) else [x])]
    return flat or ([quant["bits"]] if quant.get("bits") else [])


def usage_block(kind: str, ref: str, revision: str | None = None) -> str:
    """The marked snippet for ``kind``, loading ``ref`` (a repo id or a local folder)."""
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r} (known: {', '.join(KINDS)})")
    args = json.dumps(ref) + (f", revision={json.dumps(revision)}" if revision else "")
    fields = {"ref": args, "gptq_import": "", "gptq_path": json.dumps(ref)}
    if revision:  # GPTQModel.load takes a folder or an id; a branch is downloaded first
        fields.update(gptq_import="from huggingface_hub import snapshot_download\n",
                      gptq_path=f"snapshot_download({args})")
    body = Template((TEMPLATES / f"usage-{kind}.md").read_text()).substitute(fields)
    return f"{START}\n{body.strip()}\n{END}"


def set_usage(text: str, kind: str, ref: str, revision: str | None = None) -> str | None:
    """``text`` with its usage block replaced; None if it has no (single) layercut usage block."""
    if len(_BLOCK.findall(text)) != 1:
        return None
    block = usage_block(kind, ref, revision)
    return _BLOCK.sub(lambda _: block, text)
