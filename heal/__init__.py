"""LoRA healing (peft): distil the original model back into the compressed one, then merge.

Usage::

    layercut heal pruned/ --teacher bundled:smollm2-135m -o healed/ --steps 200

    from layercut.heal.train import heal_model          # heal_model(student, teacher, tokenizer, HealConfig(...))
    from layercut.heal.config import HealConfig

Modules: ``losses`` (KL / top-k KL / LM tensor cores), ``lora`` (peft targets from the arch
table, dequantized inputs, compatibility checks), ``data`` (windows, top-k teacher cache),
``state`` (checkpoint / resume without pickles), ``train`` (the loop and the merge).
"""


if __name__ != "layercut.heal":  # a checkout on sys.path must not load a second copy
    raise ImportError("import layercut.heal, not heal: layercut installs one top-level package "
                      "(pip install -e . from the checkout)")

from layercut import make_callable  # noqa: E402 (after the guard)

make_callable(__name__)  # layercut.heal(...) is the API's heal(); see layercut/__init__.py
