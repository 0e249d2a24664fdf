"""Quantizing the untied output head (``--quantize-head``): the solve, the checkpoint, the loaders.

A tiny untied llama (conftest's config: ``tie_word_embeddings`` is False) is quantized at 4 bits
g32 with its head at 8g32 (a ``dynamic`` entry) and at 4g32 (the base pair). The packed head
decodes to the in-memory weights, its Hessian is that of the head's real inputs, slicing the
solve changes nothing, and GPTQModel 7.6.0 and layercut's loader give the same logits. The CLI
path (streamed, the default for a checkpoint) writes what the whole-model path writes. Bad
input: one line, exit 2, nothing written.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from layercut.calibrate.capture import run_blocks
from layercut.calibrate.data import CalibSet, calibration_batch
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.checkpoint import save_quantized
from layercut.compress.quant.format.loader import load_quantized
from layercut.compress.quant.format.pack import dequantize_gptq
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.solve.driver import quantize_model
from layercut.compress.quant.solve.gptq import hessian_update
from layercut.compress.quant.solve.head import check_head, head_hessian, quantize_head
from layercut.compress.workflow.cli import main
from layercut.export.card_usage import folder_kind
from tests.conftest import tiny_config
from tests.plain_solver import plain_solver
from tests.test_cli_errors import check_one_error, tree

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
GS = 32
ATOL = 5e-3  # as tests/test_quantize.py: fp16 embeddings/norms, GPTQModel's fp16 compute


def small_model(layers: int = 2, tied: bool = False):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers, cfg.tie_word_embeddings = layers, tied
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _calib(tok, n=8, L=32) -> CalibSet:
    return calibration_batch(tok, "bundled:brown-calib", samples=n, seq_len=L, seed=0)


def _probe(tok) -> torch.Tensor:
    return calibration_batch(tok, "bundled:brown-heldout", samples=2, seq_len=24, seed=1).input_ids


@pytest.fixture(scope="module")
def headq(tmp_path_factory, tiny_tokenizer):
    """Checkpoints with the head at 8g32 (differs from the base 4g32) and at 4g32, + in-memory logits."""
    out = {}
    probe = _probe(tiny_tokenizer)
    for kind, head in (("8g32", (8, GS)), ("4g32", (4, GS))):
        model = small_model()
        res = quantize_model(model, _calib(tiny_tokenizer), plain_solver(bits=4, group_size=GS), batch_size=4,
                             progress=False, head=head)
        path = tmp_path_factory.mktemp("qh") / kind
        save_quantized(model, tiny_tokenizer, res, path)
        with torch.no_grad():
            logits = model(probe).logits
        out[kind] = (path, logits, model, res)
    return out, probe


def test_packed_head_decodes_to_the_in_memory_head_and_config_says_so(headq):
    entries, _ = headq
    for kind, bits in (("8g32", 8), ("4g32", 4)):
        path, _, model, res = entries[kind]
        q = res.layers["lm_head"]
        assert res.head == "lm_head" and q.bits == bits and q.group_size == GS
        t = q.tensors
        W = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
        assert torch.equal(W, model.lm_head.weight.detach())
        assert len(res.body()) == 2 * 7 and res.avg_bits() < 5  # the head is not in the blocks' average
        qc = json.loads((path / "config.json").read_text())["quantization_config"]
        assert qc["lm_head"] is True and (qc["bits"], qc["group_size"]) == (4, GS)
        if bits == 8:
            assert qc["dynamic"] == {"+:lm_head$": {"bits": 8, "group_size": GS}}
        else:
            assert "dynamic" not in qc
        assert qc["modules_in_block_to_quantize"][-1] == ["lm_head"]  # vLLM's is-quantized test
        # stock transformers loads a random dense head from such a checkpoint: the card says GPTQModel
        assert folder_kind(path) == "gptq-mixed"
        from safetensors import safe_open

        with safe_open(str(next(path.glob("*.safetensors"))), "pt") as fh:
            keys = set(fh.keys())
        assert {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales", "lm_head.g_idx"} <= keys
        assert "lm_head.weight" not in keys


def test_head_hessian_is_that_of_the_heads_real_inputs(tiny_tokenizer):
    """H from norm(h_L) of the driver's stream == H of what lm_head receives in a forward pass
    (padding masked). Red if the norm is skipped or padded tokens are counted."""
    model = small_model()
    calib = _calib(tiny_tokenizer)
    mask = calib.attention_mask.clone()
    mask[::2, 20:] = 0  # right padding on half the rows
    calib = CalibSet(calib.input_ids, mask)
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, inp, _o: seen.append(inp[0].detach()))
    with torch.no_grad():
        for ids, m in calib.split(4):
            model(input_ids=ids, attention_mask=m)
    handle.remove()
    H_ref, n_ref = None, 0
    for x, (_, m) in zip(seen, calib.split(4)):
        H_ref, n_ref = hessian_update(H_ref, n_ref, x, m)
    h_last = run_blocks(model, calib, [], batch_size=4, progress=False)
    H, n = head_hessian(model, h_last, [m.bool() for _, m in calib.split(4)])
    assert n == n_ref == int(mask.sum())
    torch.testing.assert_close(H, H_ref, rtol=1e-5, atol=1e-6)


def test_sliced_head_solve_equals_one_solve_and_beats_rtn(tiny_tokenizer):
    """Slices of 64 rows (6 of the 384-row head) give the bytes of one solve. Red if slices are
    joined along the wrong axis or the packed zero points are misaligned; and GPTQ on H must beat
    round-to-nearest in the head's own output error (red if H is ignored)."""
    model = small_model()
    calib = _calib(tiny_tokenizer)
    H, _ = head_hessian(model, run_blocks(model, calib, [], batch_size=4, progress=False),
                        [m.bool() for _, m in calib.split(4)])
    cfg = plain_solver(bits=4, group_size=GS, act_order=True, static_groups=True)
    packed = {}
    for rows in (64, 1 << 14):
        m = copy.deepcopy(model)
        for bits in (3, 4):
            packed[rows, bits] = quantize_head(m, H, bits, GS, cfg, QuantizeResult(config=cfg), rows=rows)
    for bits in (3, 4):
        a, b = packed[64, bits], packed[1 << 14, bits]
        for k in ("qweight", "qzeros", "scales", "g_idx"):
            assert torch.equal(a.tensors[k], b.tensors[k]), (bits, k)
        assert a.loss == pytest.approx(b.loss, rel=1e-4)
    rtn = quantize_head(copy.deepcopy(model), None, 4, GS, plain_solver(bits=4, group_size=GS, method="rtn"),
                        QuantizeResult(config=cfg))
    W = model.lm_head.weight.detach()
    t = rtn.tensors
    dW = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4) - W
    rtn_loss = float(((dW @ H.float()) * dW).sum() / 2)
    assert packed[1 << 14, 4].loss < 0.9 * rtn_loss


# ------------------------------------------------------------------ the loaders


def test_layercut_loader_reads_the_quantized_head(headq):
    entries, probe = headq
    for kind in ("8g32", "4g32"):
        path, logits, _, _ = entries[kind]
        model = load_quantized(path)
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == int(kind[0])
        with torch.no_grad():
            torch.testing.assert_close(model(probe).logits, logits, atol=ATOL, rtol=0)


def test_heal_reads_the_dims_of_a_quantized_head(headq):
    """Healing a quantized-head checkpoint must see its vocabulary (a QuantLinear has no .weight)."""
    from layercut.heal.lora import check_descendant, model_dims

    path, _, _, _ = headq[0]["8g32"]
    model = load_quantized(path)
    dense = small_model()
    assert model_dims(model) == model_dims(dense)
    check_descendant(model, dense)


@pytest.mark.parametrize("kind", ["8g32", "4g32"])
def test_gptqmodel_loads_the_quantized_head(headq, kind):
    """GPTQModel 7.6.0 reads lm_head as a quantized module (``lm_head: true``, bits from
    ``dynamic``) and its logits match layercut's loader. Red without the dynamic entry (GPTQModel
    then reads the head at the base bits and the packed tensors do not fit)."""
    from gptqmodel import BACKEND, GPTQModel

    entries, probe = headq
    path, logits, _, _ = entries[kind]
    model = GPTQModel.load(str(path), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    head = model.model.lm_head
    assert type(head).__module__.startswith("gptqmodel.") and head.bits == int(kind[0])
    ours = load_quantized(path)
    with torch.no_grad():
        got = model.model(probe).logits.float()
        torch.testing.assert_close(got, ours(probe).logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, logits, atol=ATOL, rtol=0)


def test_streamed_eval_reads_the_quantized_head(headq, tiny_tokenizer):
    """``layercut eval`` streams GPTQ checkpoints block by block, the head dequantized a vocabulary
    slice at a time: same perplexity as the whole loaded model (red if the streamed path read the
    head dense, or at the base bits)."""
    from layercut.compress.eval.evaluate import evaluate
    from layercut.compress.eval.stream_eval import evaluate_streamed

    entries, _ = headq
    path = entries["8g32"][0]
    streamed = evaluate_streamed(str(path), text="bundled:brown-heldout", ctx=32, max_tokens=128, progress=False)
    whole = evaluate(load_quantized(path), tiny_tokenizer, text="bundled:brown-heldout", ctx=32, max_tokens=128,
                     progress=False)
    assert streamed.ppl == pytest.approx(whole.ppl, rel=1e-4)


# ------------------------------------------------------------------ the stage / CLI


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("untied")
    small_model().save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tied")
    small_model(tied=True).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_cli_streamed_head_matches_whole_model(untied_dir, tmp_path, tiny_tokenizer, capsys):
    """``layercut quantize DIR --quantize-head 8g32`` streams (one block in memory); it must write
    the checkpoint the whole-model path writes. Red if the streamed writer keeps the dense head
    or drops the packed one. quantize.json and the card's bits table name the head."""
    from layercut.export.card_body import bits_table

    outs = {}
    for how in ("streamed", "whole"):
        out = tmp_path / how
        argv = ["quantize", str(untied_dir), "-o", str(out), "--bits", "4", "--group-size", str(GS),
                "--quantize-head", "8g32", "--samples", "8", "--seq-len", "32", "--json"]
        assert main(argv + (["--whole-model"] if how == "whole" else [])) == 0, capsys.readouterr().err
        capsys.readouterr()
        outs[how] = out
    probe = _probe(tiny_tokenizer)
    with torch.no_grad():
        a, b = (load_quantized(outs[h])(probe).logits for h in ("streamed", "whole"))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    report = json.loads((outs["streamed"] / "quantize.json").read_text())
    assert report["head"]["module"] == "lm_head" and report["head"]["bits"] == 8
    assert report["bits_per_layer"] == {"all linears": 4, "lm_head": "8g32"}
    assert "| lm_head | 8 (32) |" in bits_table(report)  # the card's "Bits per layer" table


def test_no_head_is_refused():
    from transformers import LlamaModel

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 1
    with pytest.raises(LayercutError, match="no output head"):
        check_head(LlamaModel(cfg), 8, GS)


HEAD_CASES = [
    ("tied", True, ["--quantize-head", "8g32"], ["head (lm_head) is tied", "benchmarks/head.py"]),
    ("bits", False, ["--quantize-head", "5g32"], ["--quantize-head: bits must be one of 2, 3, 4, 8, got 5"]),
    ("group-size", False, ["--quantize-head", "8g48"], ["group size 48 does not divide the hidden size 64"]),
    ("not-a-spec", False, ["--quantize-head", "8x"], ["--quantize-head: expected e.g. 8g128, 4g64, 8ch or 8, got '8x'"]),
    ("with-avg-bits", False, ["--quantize-head", "8"], ["with --avg-bits it is not supported yet"]),
]


@pytest.mark.parametrize("case", HEAD_CASES, ids=[c[0] for c in HEAD_CASES])
def test_bad_head_input(case, untied_dir, tied_dir, tmp_path, capsys):
    name, tied, extra, words = case
    model = tied_dir if tied else untied_dir
    bits = ["--avg-bits", "3.5"] if name == "with-avg-bits" else ["--bits", "4"]
    argv = ["quantize", str(model), "-o", str(tmp_path / "out"), *bits, "--group-size", str(GS), *extra]
    before, before_model = tree(tmp_path), tree(model)
    check_one_error(capsys, argv, words)
    assert tree(tmp_path) == before and tree(model) == before_model
