"""Export, model cards and Hub push, installed as ``layercut.export``."""

import sys
import types

if __name__ != "layercut.export":  # a checkout on sys.path must not load a second copy
    raise ImportError("import layercut.export, not export: layercut installs one top-level package "
                      "(pip install -e . from the checkout)")


class _CallableModule(types.ModuleType):
    """``layercut.export(...)`` is the Python API's :func:`layercut.api.export`; see ``layercut/__init__.py``."""

    def __call__(self, *args, **kwargs):
        from layercut.api import export

        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
