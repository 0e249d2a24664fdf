"""Errors that layercut reports to users as one clear line (see layercut.compress.cli)."""

from __future__ import annotations


class LayercutError(Exception):
    """A user-facing error: bad input, unsupported model, impossible request.

    The CLI prints ``error: <message>`` on one line and exits with ``exit_code``.
    """

    exit_code = 2


class GateFailed(LayercutError):
    """A quality gate (``--max-ppl-increase``, ``--max-kl``) failed."""

    exit_code = 3
