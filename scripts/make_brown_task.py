"""Build the shipped lm-eval task ``brown_cloze`` from the bundled held-out Brown text.

Run (the result is committed; rerun only to change the task, then bump its version)::

    python scripts/make_brown_task.py            # writes compress/eval/tasks/brown_cloze/brown_cloze.jsonl
    python scripts/make_brown_task.py --check    # exit 1 if the shipped file differs from a rebuild

The task is a LAMBADA-like cloze in multiple-choice form. From each paragraph of
``bundled:brown-test`` (the reporting half of the held-out files; nothing trains on it)
take the last sentence that ends in ``<word>.``, where ``<word>`` is lowercase, alphabetic,
3+ letters and not an abbreviation. The item's context is the paragraph up to that word
(whole sentences, at most ``MAX_CONTEXT_WORDS`` words, at least ``MIN_CONTEXT_WORDS``); the
answer is the word; the three distractors are other sentence-final words (lowercase, 3+
letters) of the same document, so on the same topic, within 2 letters of the answer's length
(so that a length prior alone does not win; the whole text's words where a document has too few).
``ITEMS_PER_DOC`` paragraphs are drawn from each of the 50 documents and the answer's
position among the 4 choices is drawn too, all by ``random.Random(SEED)`` in document order:
the output is the same byte for byte on every run. Chance accuracy is 0.25.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "compress" / "eval" / "tasks" / "brown_cloze" / "brown_cloze.jsonl"
SOURCE = "bundled:brown-test"
SEED = 16
ITEMS_PER_DOC = 8
MIN_CONTEXT_WORDS = 20
MAX_CONTEXT_WORDS = 90
CHOICES = 4
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z0-9])")
_TARGET = re.compile(r"^(.*\s)([a-z]{3,})\.$", re.DOTALL)  # "... context word." -> (context, word)
_ENDING = re.compile(r"(?<=\s)([a-z]{3,})\.(?=\s|$)")  # a sentence-final word, for distractors
_ABBREVIATIONS = {"etc", "esp", "approx", "dept", "incl", "misc", "viz", "vol", "pp"}


def sentence_target(sentences: list[str], end: int) -> tuple[str, str] | None:
    """(context, word) for the sentence ``sentences[end]`` ending in ``word.``, or None."""
    match = _TARGET.match(sentences[end])
    if match is None or match.group(2) in _ABBREVIATIONS:
        return None
    last = match.group(1).rstrip()
    start = end  # widen the context backwards by whole sentences while it stays short enough
    while start > 0 and len(" ".join(sentences[start - 1:end] + [last]).split()) <= MAX_CONTEXT_WORDS:
        start -= 1
    context = " ".join(sentences[start:end] + [last])
    if not MIN_CONTEXT_WORDS <= len(context.split()) <= MAX_CONTEXT_WORDS:
        return None
    return context, match.group(2)


def paragraph_item(paragraph: str) -> tuple[str, str] | None:
    """The paragraph's last usable (context, word), or None."""
    sentences = [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]
    for end in range(len(sentences) - 1, -1, -1):
        found = sentence_target(sentences, end)
        if found is not None:
            return found
    return None


def build_items(docs: list[str]) -> list[dict]:
    """The task's rows: ``id``, ``context``, ``choices`` (4 words), ``label`` (index of the answer), ``answer``."""
    rng = random.Random(SEED)
    per_doc = [[(p, item) for p, para in enumerate(doc.split("\n")) if (item := paragraph_item(para))]
               for doc in docs]
    pools = [sorted(set(_ENDING.findall(doc)) - _ABBREVIATIONS) for doc in docs]
    everywhere = sorted({w for pool in pools for w in pool})
    rows = []
    for d, found in enumerate(per_doc):
        for p, (context, answer) in sorted(rng.sample(found, min(ITEMS_PER_DOC, len(found)))):
            near = [w for w in pools[d] if w != answer and abs(len(w) - len(answer)) <= 2]
            if len(near) < CHOICES - 1:  # a short document: words from the whole text
                near = [w for w in everywhere if w != answer and abs(len(w) - len(answer)) <= 2]
            choices = rng.sample(near, CHOICES - 1)
            label = rng.randrange(CHOICES)
            choices.insert(label, answer)
            rows.append({"id": f"brown-test/{d}/{p}", "context": context, "choices": choices,
                         "label": label, "answer": answer})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output .jsonl (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from layercut.calibrate.data import load_texts

    text = render(build_items(load_texts(SOURCE)))
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'matches' if same else 'DIFFERS from'} a rebuild")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {text.count(chr(10))} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
