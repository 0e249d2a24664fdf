"""LoRA healing (peft): distil the original model back into the compressed one, then merge.

Usage::

    layercut heal pruned/ --teacher bundled:smollm2-135m -o healed/ --steps 200

    from heal.train import heal_model          # heal_model(student, teacher, tokenizer, HealConfig(...))
    from heal.config import HealConfig

Modules: ``losses`` (KL / top-k KL / LM tensor cores), ``lora`` (peft targets from the arch
table, dequantized inputs, compatibility checks), ``data`` (windows, top-k teacher cache),
``state`` (checkpoint / resume without pickles), ``train`` (the loop and the merge).
"""
