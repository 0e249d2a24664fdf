"""The capture driver reproduces each model's own forward, block by block, for every family."""

from __future__ import annotations

import pytest
import torch

from layercut.calibrate.capture import capture_inputs, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.calibrate.stats import CosineStats, GramStats, last_token_index, last_tokens
from layercut.compress.core.arch import arch_for, get_submodule
from tests.conftest import FAMILIES, build_tiny_model


def _reference_states(model, calib):
    out = model(input_ids=calib.input_ids, attention_mask=calib.attention_mask, output_hidden_states=True)
    return out.hidden_states


@pytest.mark.parametrize("family", FAMILIES)
def test_arch_table_locates_modules(family):
    model = build_tiny_model(family)
    spec = arch_for(model)
    layers = spec.layers_of(model)
    assert len(layers) == model.config.num_hidden_layers
    block = layers[0]
    for name, module in spec.linears(block):
        assert hasattr(module, "weight"), name
    for path in (spec.attn, spec.mlp, spec.attn_norm, spec.mlp_norm, spec.attn_out, spec.mlp_out, spec.down_proj):
        get_submodule(block, path)
    get_submodule(spec.base_of(model), spec.embed)
    get_submodule(spec.base_of(model), spec.final_norm)
    assert spec.post_mlp_norm == family.startswith("gemma")


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_driver_matches_model_forward(family, calib):
    model = build_tiny_model(family)
    padded = CalibSet(calib.input_ids.clone(), calib.attention_mask.clone())
    padded.attention_mask[1, 20:] = 0  # right padding on one row
    padded.input_ids[1, 20:] = 0
    ref = _reference_states(model, padded)
    seen = []

    def check(run):
        got = torch.cat(run.inputs)
        torch.testing.assert_close(got, ref[run.index], atol=1e-4, rtol=1e-4)
        attn, mlp, outs = run.sublayer_outputs()
        # What the two sublayers add to the residual stream sums to the block output.
        summed = torch.cat([h + a + m for h, a, m in zip(run.inputs, attn, mlp)])
        torch.testing.assert_close(summed, torch.cat(outs), atol=1e-4, rtol=1e-4)
        seen.append(run.index)

    h_last = run_blocks(model, padded, [check], batch_size=4, progress=False)
    assert seen == list(range(model.config.num_hidden_layers))
    # transformers 5: hidden_states[-1] is after the final norm; the driver returns the raw stream.
    spec = arch_for(model)
    final_norm = get_submodule(spec.base_of(model), spec.final_norm)
    torch.testing.assert_close(final_norm(torch.cat(h_last)), ref[-1], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_stage_can_modify_block_and_next_block_sees_it(calib):
    model = build_tiny_model("llama")
    spec = arch_for(model)
    seen_inputs = {}

    def zero_mlp_of_block_1(run):
        seen_inputs[run.index] = torch.cat(run.inputs).clone()
        if run.index == 1:
            before = torch.cat(run.outputs()).clone()
            get_submodule(run.block, spec.down_proj).weight.zero_()
            run.invalidate()
            after = torch.cat(run.outputs())
            assert not torch.allclose(before, after)
            seen_inputs["after1"] = after

    run_blocks(model, calib, [zero_mlp_of_block_1], batch_size=3, progress=False)
    torch.testing.assert_close(seen_inputs[2], seen_inputs["after1"])


def test_capture_records_per_layer_kwargs_for_gemma3(calib):
    """Gemma3 gives local and global layers different masks and rotary tables."""
    model = build_tiny_model("gemma3_text")
    first, call_args = capture_inputs(model, calib, batch_size=6)
    types = model.config.layer_types
    assert len(set(types)) == 2
    local = call_args[types.index("sliding_attention")][0][1]
    glob = call_args[types.index("full_attention")][0][1]
    assert not torch.equal(local["position_embeddings"][0], glob["position_embeddings"][0])
    assert first[0].shape == (6, calib.seq_len, model.config.hidden_size)


def test_hook_forward_and_gram_accumulator(calib):
    model = build_tiny_model("llama")
    calib = CalibSet(calib.input_ids.clone(), calib.attention_mask.clone())
    calib.attention_mask[1, 20:] = 0  # right padding: its tokens must not enter the Gram matrix
    calib.input_ids[1, 20:] = 0
    grams = {}

    def hessians(run):
        g = GramStats(dim_x=model.config.intermediate_size)
        run.forward(hooks={"mlp.down_proj": lambda i, x, y: g.update(x, mask=run.masks[i])})
        grams[run.index] = g

    run_blocks(model, calib, [hessians], batch_size=4, progress=False)
    # reference: down_proj's inputs in block 3 of one plain model forward, real tokens only
    seen = []
    handle = model.model.layers[3].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with torch.no_grad():
        model(input_ids=calib.input_ids, attention_mask=calib.attention_mask)
    handle.remove()
    x = seen[0][calib.attention_mask.bool()].double()  # [tokens, intermediate]
    g = grams[3]
    assert g.count == x.shape[0] == int(calib.attention_mask.sum())
    torch.testing.assert_close(g.xtx, x.T @ x, rtol=1e-4, atol=1e-4 * float(x.square().sum(0).max()))
    torch.testing.assert_close(g.hessian(), (2.0 / x.shape[0] * x.T @ x).float(), rtol=1e-4, atol=1e-6)


def test_stats_mask_and_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 3]
    h = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    assert torch.equal(last_tokens(h, mask), torch.stack([h[0, 2], h[1, 3]]))
    stats = CosineStats()
    a = torch.randn(2, 4, 3)
    stats.update(a, a, mask)
    assert stats.count == 7
    assert abs(stats.mean_cosine() - 1) < 1e-9 and stats.mean_angle() < 1e-4
    stats2 = CosineStats()
    stats2.update(a, -a, mask)
    assert abs(stats2.mean_angle() - 1) < 1e-6


def test_blocks_run_on_the_stage_device(calib, monkeypatch):
    """A stage's --device reaches the driver: each block and its activations move there for its turn.

    No second device exists on a CPU machine, so the compute device is the meta device: the
    callback sees the block and its inputs there (and stops the pass)."""
    from layercut.compress.core import devices

    model = build_tiny_model("llama")
    seen = {}

    class Stop(Exception):
        pass

    def record(run):
        seen["block"] = next(run.block.parameters()).device
        seen["inputs"] = run.inputs[0].device
        raise Stop

    monkeypatch.setattr(devices, "resolve_device", lambda name: torch.device("meta"))
    with devices.compute_device("cuda"), pytest.raises(Stop):
        run_blocks(model, calib, [record], batch_size=3, progress=False)
    assert seen == {"block": torch.device("meta"), "inputs": torch.device("meta")}
    assert devices.current_device() is None  # the setting ends with the stage
    seen.clear()
    with pytest.raises(Stop):
        run_blocks(build_tiny_model("llama"), calib, [record], batch_size=3, progress=False)
    assert seen == {"block": torch.device("cpu"), "inputs": torch.device("cpu")}
