"""Peak resident memory of one stage of a run.

Usage::

    from layercut.compress.core.resources import PeakRSS
    with PeakRSS() as rss:
        work()
    rss.peak_mb, rss.method      # e.g. 812.4, "vmhwm"

On Linux the kernel's high-water mark (``VmHWM``) is reset at entry by writing ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0) and read at exit, so the figure is the stage's
own peak, not the process's. Where that is not possible (or the reset is silently
ignored, as in some sandboxes) a 50 ms sampling thread (psutil)
measures it instead (``method == "sampled"``).
"""

from __future__ import annotations

import threading
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _vmhwm_kb() -> int | None:
    return _status_kb("VmHWM")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel ignores the request (some
    sandboxes accept the write and change nothing)."""
    _CLEAR.write_text("5")
    hwm, rss = _vmhwm_kb(), _status_kb("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss * 1.05 + 8 * 1024


class PeakRSS:
    """Context manager measuring the peak RSS (MB) inside its block."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self.method = "vmhwm"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak_bytes = 0

    def __enter__(self) -> PeakRSS:
        try:
            if not _reset_hwm():
                raise OSError("VmHWM cannot be reset here")
        except OSError:
            self.method = "sampled"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import psutil

        proc = psutil.Process()
        while not self._stop.is_set():
            self._peak_bytes = max(self._peak_bytes, proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_mb = round(self._peak_bytes / 2**20, 1)
        else:
            self.peak_mb = round((_vmhwm_kb() or 0) / 1024, 1)
