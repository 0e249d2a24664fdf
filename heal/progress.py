"""Progress for the heal phases: a tqdm bar on a terminal, plain lines otherwise.

Usage::

    from layercut.heal.progress import progress_bar
    bar = progress_bar(total=200, desc="heal", unit="step", enabled=progress)
    bar.update(1); bar.set_postfix(loss="2.31", tok_s="540"); bar.close()
    for batch in progress_bar(batches, desc="teacher top-k", unit="batch", enabled=progress): ...

When stderr is not a terminal (a log file, CI, a pipe) a tqdm bar writes carriage-return redraws
that read as one garbled line; there :class:`LineProgress` prints one plain line every
``every`` percent (and at the end) instead: ``heal: 40/200 steps (20%), 12.1 s, loss=2.31, tok_s=540``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm.auto import tqdm


class LineProgress:
    """The part of tqdm's interface the heal loop uses, printing a line every ``every`` percent."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every: float = 5.0, stream=None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.every = every
        self.stream = stream if stream is not None else sys.stderr
        self.postfix: dict[str, Any] = {}
        self.t0 = time.perf_counter()
        self._printed = -1.0  # percent of the last line
        self._closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def set_postfix(self, **kwargs: Any) -> None:
        self.postfix = kwargs

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.total:
            pct = 100.0 * self.n / self.total
            if pct >= self._printed + self.every or self.n >= self.total:
                self._line()
                self._printed = pct

    def _line(self) -> None:
        done = f"{self.n}/{self.total} {self.unit}" + (f" ({100.0 * self.n / self.total:.0f}%)" if self.total else "")
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc}: {done}, {time.perf_counter() - self.t0:.1f} s{extra}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.total is None or (self.n and self._printed < 100.0 * self.n / self.total):
            self._line()


def progress_bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 initial: int = 0, enabled: bool = True):
    """A tqdm bar when stderr is a terminal, a :class:`LineProgress` when it is not, nothing when disabled."""
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial)
