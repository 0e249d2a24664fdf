"""The group-size default: 128 where it divides every quantized linear's inputs, else 64, 32, -1."""

from __future__ import annotations

import pytest
import torch

from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.solve.driver import auto_group_size
from layercut.compress.workflow.stages.quantize import quantize_model
from tests.conftest import build_tiny_model, tiny_config


def _llama(hidden: int, inter: int):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = hidden, inter, hidden // cfg.num_attention_heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize(("hidden", "inter", "expected"), [(128, 256, 128), (128, 192, 64), (96, 160, 32),
                                                           (72, 144, -1)])
def test_auto_group_size_is_the_largest_that_divides_every_input(hidden, inter, expected):
    """Red if the default ignored down_proj's input (the intermediate size) or preferred a smaller group."""
    assert auto_group_size(_llama(hidden, inter)) == expected


def test_the_default_is_resolved_per_model_and_reported(tiny_tokenizer):
    model = _llama(128, 256)
    config = QuantizeConfig(bits=4, samples=2, seq_len=16, method="rtn")
    assert config.group_size is None
    quantize_model(model, tiny_tokenizer, config, progress=False)  # RTN: no calibration forward needed
    # 128 columns per group: the first down_proj row's 256 inputs hold exactly 2 distinct scales
    w = model.model.layers[0].mlp.down_proj.weight[0]
    spans = [len(torch.unique(w[i:i + 128])) <= 16 for i in (0, 128)]
    assert all(spans) and len(torch.unique(w)) > 16


def test_small_model_default_matches_the_old_64(tiny_tokenizer):
    assert auto_group_size(build_tiny_model("llama")) == 64
