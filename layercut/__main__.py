"""``python -m layercut`` (and ``torchrun -m layercut``): the ``layercut`` console script."""

from __future__ import annotations

import sys

from layercut.cli import main

if __name__ == "__main__":
    sys.exit(main())
