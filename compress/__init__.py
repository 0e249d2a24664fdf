"""Compression algorithms and stages, installed as ``layercut.compress``."""

if __name__ != "layercut.compress":  # a checkout on sys.path must not load a second copy
    raise ImportError("import layercut.compress, not compress: layercut installs one top-level package "
                      "(pip install -e . from the checkout)")

