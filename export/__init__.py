"""Export, model cards and Hub push, installed as ``layercut.export``."""


if __name__ != "layercut.export":  # a checkout on sys.path must not load a second copy
    raise ImportError("import layercut.export, not export: layercut installs one top-level package "
                      "(pip install -e . from the checkout)")

from layercut import make_callable  # noqa: E402 (after the guard)

make_callable(__name__)  # layercut.export(...) is the API's export(); see layercut/__init__.py
