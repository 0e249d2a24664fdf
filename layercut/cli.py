"""The ``layercut`` console script: ``python -m layercut.cli`` is the same program."""

from __future__ import annotations

import sys

from layercut.compress.workflow.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
