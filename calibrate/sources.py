"""Text sources: what one entry of a stage's ``calib`` / ``data`` names, and its documents.

Usage::

    from layercut.calibrate.sources import TextSource, documents
    src = TextSource(source="hf:/data/chat@train[:500]", messages_field="messages", chat_template=True)
    for doc in documents(src, tokenizer):     # each conversation rendered by the tokenizer's template
        ...

A source is ``bundled:NAME`` (the Brown splits in ``calibrate/data``), a ``.txt`` file
(documents separated by blank lines), a ``.jsonl`` file (a ``"text"`` field per line, or
``text_field``; with ``chat_template`` a ``"messages"`` field, or ``messages_field``) or
``hf:NAME[:CONFIG][@SPLIT]``, read by ``datasets.load_dataset`` (NAME: a Hub id in the
local cache, or a folder of data files such as ``train.jsonl``; a ``save_to_disk``
folder is refused). SPLIT is any split string ``datasets`` reads: ``train[:1000]``,
``train[10%:20%]``, ``train+validation``. A conversation is a list of ``{"role", "content"}``
dicts, rendered with ``tokenizer.apply_chat_template(messages, tokenize=False)``.
Torch-free: the stage configs import :class:`TextSource`.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from layercut.compress.core.errors import LayercutError, unknown_key_message

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_TEXTS = {name: f"{name}.txt.gz"
                 for name in ("brown-calib", "brown-heldout", "brown-val", "brown-test")}
FIELD_KEYS = ("text_field", "messages_field", "chat_template")


def source_kind(source: str) -> str:
    """``bundled``, ``hf``, ``jsonl`` or ``text`` (any other file)."""
    if source.startswith("bundled:"):
        return "bundled"
    if source.startswith("hf:"):
        return "hf"
    return "jsonl" if source.endswith((".jsonl", ".jsonl.gz")) else "text"


class TextSource(BaseModel):
    """One source of calibration or training text, and its share of the windows drawn.

    >>> TextSource(source="data/chat.jsonl", chat_template=True, weight=0.3).messages_key
    'messages'
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    source: str = Field(min_length=1, description="bundled:NAME, a .txt or .jsonl file, or hf:NAME[:CONFIG][@SPLIT]")
    weight: float = Field(1.0, gt=0, description="share of the windows drawn from this source, relative to the "
                                                 "other sources' weights")
    text_field: str | None = Field(None, min_length=1, description="the text column or JSON key (none: text)")
    messages_field: str | None = Field(None, min_length=1, description="the conversations column or JSON key "
                                                                       "(none: messages)")
    chat_template: bool = Field(False, description="render each conversation with the tokenizer's chat template")

    @model_validator(mode="before")
    @classmethod
    def _entry(cls, data: Any) -> Any:
        if isinstance(data, str):  # a bare string in a list of sources
            return {"source": data}
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(unknown_key_message(str(unknown[0]), list(cls.model_fields)))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TextSource:
        kind = source_kind(self.source)
        given = [k for k in FIELD_KEYS if getattr(self, k) not in (None, False)]
        if given and kind in ("bundled", "text"):
            raise ValueError(f"{given[0]} applies to .jsonl files and hf: datasets, not to '{self.source}'")
        if self.text_field is not None and (self.messages_field is not None or self.chat_template):
            raise ValueError("text_field names plain text; messages_field and chat_template name conversations: "
                             "give one or the other")
        if self.messages_field is not None and not self.chat_template:
            raise ValueError(f"messages_field '{self.messages_field}' needs chat_template (conversations are "
                             "rendered with the tokenizer's chat template)")
        return self

    @property
    def messages_key(self) -> str | None:
        """The field holding conversations, or None for plain text."""
        return (self.messages_field or "messages") if self.chat_template else None

    @property
    def text_key(self) -> str:
        return self.text_field or "text"

    def label(self) -> dict[str, Any]:
        """The source as a report shows it: only the keys that differ from the defaults, plus the weight."""
        return {**self.model_dump(exclude_defaults=True), "weight": self.weight}


# ---------------------------------------------------------------------------- documents
def documents(src: TextSource, tokenizer: Any = None) -> Iterator[str]:
    """The documents of ``src``, in order. Problems with the source itself (missing file, field
    or slice, no chat template) raise here; a bad row raises when it is reached."""
    if src.chat_template:
        if tokenizer is None:
            raise LayercutError(f"{src.source}: chat_template needs the model's tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise LayercutError(f"{src.source}: --chat-template, but the tokenizer has no chat template "
                                "(give text, or a model whose tokenizer has one)")
    kind = source_kind(src.source)
    if kind == "bundled":
        name = src.source.split(":", 1)[1]
        if name not in BUNDLED_TEXTS:
            raise LayercutError(f"unknown bundled text '{src.source}' (known: "
                                f"{', '.join('bundled:' + k for k in BUNDLED_TEXTS)})")
        return iter(split_documents(read_text_file(DATA_DIR / BUNDLED_TEXTS[name])))
    if kind == "hf":
        return _hf_documents(src, tokenizer)
    path = Path(src.source).expanduser()
    if not path.is_file():
        raise LayercutError(f"text source not found: {path}")
    if kind == "jsonl":
        return _jsonl_documents(path, src, tokenizer)
    return iter(split_documents(read_text_file(path)))


def read_text_file(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LayercutError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def split_documents(text: str) -> list[str]:
    return [d.strip() for d in text.replace("\r\n", "\n").split("\n\n") if d.strip()]


def check_conversation(messages: Any, where: str) -> None:
    """Refuse anything but a list of dicts with string ``role`` and ``content``, in one line."""
    if isinstance(messages, list):
        bad = [m for m in messages if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str))]
        if not bad:
            return
        got = repr(bad[0])[:60]
    else:
        got = type(messages).__name__
    raise LayercutError(f"{where}: not a list of {{role, content}} dicts with string values (got {got})")


def render(tokenizer: Any, messages: Any, where: str) -> str:
    """One conversation through the tokenizer's chat template; one-line error if it is not one."""
    check_conversation(messages, where)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # jinja raises its own errors (e.g. roles must alternate)
        raise LayercutError(f"{where}: the chat template failed: {str(exc).splitlines()[0] if str(exc) else exc!r}") \
            from exc


def _jsonl_documents(path: Path, src: TextSource, tokenizer: Any) -> Iterator[str]:
    key = src.messages_key or src.text_key
    values: list[tuple[int, Any]] = []
    for lineno, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LayercutError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
        value = record.get(key) if isinstance(record, dict) else None
        if src.chat_template:
            if value is None:
                raise LayercutError(f"{path}:{lineno}: each line needs a '{key}' field, a list of "
                                    "{role, content} dicts")
            if value:
                check_conversation(value, f"{path}:{lineno}: '{key}'")  # up front; rendered lazily
                values.append((lineno, value))
            continue
        if not isinstance(value, str):
            hint = " (conversations: add --chat-template)" if isinstance(record, dict) and "messages" in record \
                and value is None else ""
            raise LayercutError(f"{path}:{lineno}: each line needs a string '{key}' field{hint}")
        if value.strip():
            values.append((lineno, value.strip()))
    if not src.chat_template:
        return iter([v for _, v in values])
    return (render(tokenizer, v, f"{path}:{n}: '{key}'") for n, v in values)


# ---------------------------------------------------------------------------- hf datasets
_SLICE = re.compile(r"^\s*([\w.-]+)\s*(?:\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\])?\s*(?:\(\w+\))?\s*$")


def parse_hf(spec: str) -> tuple[str, str | None, str]:
    """``NAME[:CONFIG][@SPLIT]`` -> (name, config, split); the split keeps its slice.

    >>> parse_hf("/data/chat@train[:1000]"), parse_hf("wikitext:wikitext-2-raw-v1@test[10%:20%]")
    (('/data/chat', None, 'train[:1000]'), ('wikitext', 'wikitext-2-raw-v1', 'test[10%:20%]'))
    """
    name, _, split = spec.partition("@")  # before the '@' first: a slice has ':' in it too
    name, _, config = name.partition(":")
    return name, config or None, split.strip() or "train"


def _load_hf(name: str, config: str | None, split: str, spec: str):
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # datasets raises many types; report one line
        text = str(exc).splitlines()[0] if str(exc) else repr(exc)
        if "save_to_disk" in text:
            text = (f"{name} was written by save_to_disk; hf: reads data-file folders through load_dataset: "
                    f"write it with ds.to_json('{name}/train.jsonl') instead")
        elif "corresponds to no data" in text:
            text = f"the split '{split}' selects no rows"
        raise LayercutError(f"cannot load dataset '{spec}': {text}") from exc


def check_slices(split: str, rows_of: Callable[[str], int], spec: str) -> None:
    """Refuse a slice bound past the end of its split (``train[500:2000]`` of 1000 rows),
    which ``datasets`` would silently cut short."""
    for part in split.split("+"):
        match = _SLICE.match(part)
        if not match:
            continue  # datasets reports a malformed split itself
        for bound in match.group(2, 3):
            if bound and not bound.endswith("%"):
                n = rows_of(match.group(1))
                if not -n <= int(bound) <= n:
                    raise LayercutError(f"dataset '{spec}': slice '{part.strip()}' is outside split "
                                        f"'{match.group(1)}' ({n} rows)")


def _hf_documents(src: TextSource, tokenizer: Any) -> Iterator[str]:
    spec = src.source
    name, config, split = parse_hf(spec[3:])
    rows: dict[str, int] = {}

    def rows_of(split_name: str) -> int:
        if split_name not in rows:
            rows[split_name] = len(_load_hf(name, config, split_name, spec))
        return rows[split_name]

    check_slices(split, rows_of, spec)
    ds = _load_hf(name, config, split, spec)
    if len(ds) == 0:
        raise LayercutError(f"dataset '{spec}': the split '{split}' selects no rows")
    key = src.messages_key or src.text_key
    if key not in ds.column_names:
        flag = "--messages-field" if src.chat_template else "--text-field"
        raise LayercutError(f"dataset '{spec}' has no field '{key}' (columns: {', '.join(ds.column_names)}; "
                            f"choose one with {flag})")
    feature = ds.features[key]
    if src.chat_template:
        inner = getattr(feature, "feature", None)
        if not (isinstance(inner, dict) and {"role", "content"} <= set(inner)):
            raise LayercutError(f"dataset '{spec}': field '{key}' is not a list of {{role, content}} dicts "
                                f"(its type: {feature})")
    elif getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise LayercutError(f"dataset '{spec}': field '{key}' is not text (its type: {feature})")
    return _hf_rows(ds.select_columns([key]), key, src, tokenizer)


def _hf_rows(ds, key: str, src: TextSource, tokenizer: Any) -> Iterator[str]:
    row = 0
    for batch in ds.iter(batch_size=256):  # lazily: calibration stops once it has its tokens
        for value in batch[key]:
            if src.chat_template:
                if value:
                    yield render(tokenizer, value, f"dataset '{src.source}' row {row} field '{key}'")
            elif isinstance(value, str) and value.strip():
                yield value
            row += 1
