"""Text sources, the block-by-block capture driver and streaming statistics.

The default text names live here, torch-free, so every command, recipe and benchmark reads
them from one place: calibration (and healing) text comes from the calibration files, the
evaluation text from held-out files that no calibration or healing run ever sees.
"""

if __name__ != "layercut.calibrate":  # a checkout on sys.path must not load a second copy
    raise ImportError("import layercut.calibrate, not calibrate: layercut installs one top-level package "
                      "(pip install -e . from the checkout)")


DEFAULT_CALIB_TEXT = "bundled:brown-calib"
DEFAULT_EVAL_TEXT = "bundled:brown-test"
