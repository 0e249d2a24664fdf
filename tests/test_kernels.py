"""layercut::gptq_matmul: reference maths, op registration, kernel registry, nvcc build, GPU kernels.

GPU tests (``-m gpu``) skip without CUDA; the compile test skips without nvcc (the first run
compiles for sm_80+sm_90, minutes on a small machine; later runs hit the cache).
"""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import torch
from gptq_codes import random_codes

from compress.errors import LayercutError
from compress.kernels import build, ops
from compress.quant.pack import pack_gptq

BITS = (2, 3, 4, 8)
GROUP_SIZES = (-1, 32, 64, 128)
HAS_CUDA = torch.cuda.is_available()


def make_layer(
    bits: int, in_f: int, out_f: int, gs: int, act_order: bool, seed: int = 0, device: str = "cpu"
):
    """Packed GPTQ tensors on ``device``, the dense W [out, in] they encode, and the op's group size."""
    maxq = (1 << bits) - 1
    q, z, s, g_idx, w = random_codes(bits, in_f, out_f, gs, act_order, seed, zmin=0, scale=(1 / maxq, 0.5 / maxq))
    packed = {k: v.to(device) for k, v in pack_gptq(q, z, s, g_idx, bits).items()}
    op_gs = ops.ACT_ORDER if act_order else gs
    return packed, w.to(device), op_gs


def fatbin_entries(blob: bytes) -> set[tuple[str, int]]:
    """(kind, sm) of every image in the embedded CUDA fatbins (what cuobjdump --list-elf/-ptx show).

    Fatbin: header {magic 0xBA55ED50, u16 version, u16 header size, u64 payload size}, then
    entries {u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, ..., u32 sm @28}.
    """
    magic = struct.pack("<I", 0xBA55ED50)
    found, i = set(), blob.find(magic)
    while i != -1:
        header_size, payload = struct.unpack_from("<HQ", blob, i + 6)
        j, end = i + header_size, i + header_size + payload
        while j < end:
            kind, _, entry_header, size = struct.unpack_from("<HHIQ", blob, j)
            found.add(({1: "ptx", 2: "sass"}.get(kind, str(kind)), struct.unpack_from("<I", blob, j + 28)[0]))
            j += entry_header + size
        i = blob.find(magic, end)
    return found


def call_op(x, packed, bits, op_gs):
    return torch.ops.layercut.gptq_matmul(
        x, packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits, op_gs
    )


# ---------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("act_order", [False, True])
def test_reference_matches_dense(bits: int, gs: int, act_order: bool):
    packed, w, op_gs = make_layer(bits, 576, 72, gs, act_order)
    x = torch.randn(2, 3, 576)
    y = call_op(x, packed, bits, op_gs)
    assert y.shape == (2, 3, 72) and y.dtype == torch.float32
    expected = (x.double() @ w.double().T).float()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_half_inputs_accumulate_in_fp32(dtype: torch.dtype):
    packed, w, op_gs = make_layer(4, 256, 40, 64, False)
    x = torch.randn(5, 256).to(dtype)
    y = call_op(x, packed, 4, op_gs)
    assert y.dtype == dtype
    expected = (x.float() @ w.T).to(dtype)  # fp32 product with W built from the codes, one rounding
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_op_rejects_mismatched_shapes():
    packed, _, op_gs = make_layer(4, 128, 16, 32, False)
    with pytest.raises(RuntimeError, match="features"):
        call_op(torch.randn(1, 64), packed, 4, op_gs)
    with pytest.raises(RuntimeError, match="qweight"):
        call_op(torch.randn(1, 128), packed, 8, op_gs)


def test_opcheck():
    packed, _, op_gs = make_layer(3, 64, 32, 32, True)
    args = (
        torch.randn(3, 64),
        packed["qweight"],
        packed["qzeros"],
        packed["scales"],
        packed["g_idx"],
        3,
        op_gs,
    )
    torch.library.opcheck(
        torch.ops.layercut.gptq_matmul.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_fake_impl_gives_shape_on_meta():
    packed, _, op_gs = make_layer(4, 128, 24, 32, False, device="meta")
    y = call_op(torch.empty(7, 2, 128, device="meta", dtype=torch.bfloat16), packed, 4, op_gs)
    assert y.shape == (7, 2, 24) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_import_never_initialises_cuda():
    code = (
        "import torch\n"
        "def boom(*a, **k):\n    raise SystemExit('CUDA touched at import')\n"
        "torch.cuda._lazy_init = boom\ntorch.cuda.init = boom\ntorch.cuda.current_device = boom\n"
        "torch.cuda.get_device_properties = boom\ntorch.cuda.current_stream = boom\n"
        "import compress.kernels.ops, compress.kernels.build, compress.quant.qlinear\n"
        "assert not torch.cuda.is_initialized()\nprint('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---------------------------------------------------------------- registry


def test_registry_selects_per_call(monkeypatch):
    monkeypatch.delenv("LAYERCUT_KERNELS", raising=False)
    sel = ops.select_kernel
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float16) is ops.CUDA_GEMV
    assert sel(3, ops.ACT_ORDER, "cuda", 16, 4096, 11008, torch.bfloat16) is ops.CUDA_GEMV
    assert sel(2, -1, "cuda", 17, 576, 1536, torch.float16) is ops.CUDA_DEQUANT_MATMUL
    assert sel(4, 128, "cpu", 1, 4096, 4096, torch.float16) is ops.REFERENCE
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float32) is ops.REFERENCE  # kernels take fp16/bf16
    assert sel(4, 16, "cuda", 1, 4096, 4096, torch.float16) is ops.REFERENCE  # group not a multiple of 32
    assert sel(4, 128, "cuda", 1, 100, 4096, torch.float16) is ops.REFERENCE  # in % 32 != 0
    assert sel(4, 128, "cuda", 1, 4096, 4098, torch.float16) is ops.REFERENCE  # out % 4 != 0
    assert ops.supports(8, 64, "cuda", 4) and not ops.supports(8, 64, "cpu", 4)
    assert not ops.supports(5, 64, "cuda", 4)
    monkeypatch.setenv("LAYERCUT_KERNELS", "reference")
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float16) is ops.REFERENCE


# ---------------------------------------------------------------- build (nvcc, no GPU needed)


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(LayercutError, match="no nvcc"):
        build.compile_sources(tmp_path)


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
def test_cuda_sources_compile_and_bind():
    """nvcc builds csrc/ for sm_80 and sm_90; the library loads without a GPU (static cudart)
    and its host-side API answers through ctypes."""
    lib_path = build.build_library(build.DEFAULT_ARCHS)
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib_path)], capture_output=True, text=True).stdout
    for sym in (
        "layercut_gptq_gemv",
        "layercut_gptq_dequant",
        "layercut_gemv_plan",
        "layercut_kernels_abi_version",
    ):
        assert sym in out
    # SASS for both archs and PTX for the newest (JIT on later GPUs)
    assert {("sass", 80), ("sass", 90), ("ptx", 90)} <= fatbin_entries(lib_path.read_bytes())
    lib = build.KernelLibrary(lib_path)
    for batch in (1, 4, 16):
        for in_f, out_f in ((4096, 4096), (11008, 4096), (4096, 11008), (576, 100)):
            splits, k_chunk = lib.gemv_plan(batch, in_f, out_f, sm_count=132)
            assert k_chunk % 32 == 0 and splits * k_chunk >= in_f > (splits - 1) * k_chunk
            assert k_chunk <= min(2048, 8192 // batch)  # fits the kernel's shared-memory stage
    assert lib.gemv_plan(1, 4096, 4096, sm_count=132)[0] > 1  # split-K fills the GPU at batch 1
    with pytest.raises(LayercutError, match="bad arguments"):
        lib.gemv_plan(17, 4096, 4096, sm_count=132)
    if not HAS_CUDA:  # no driver: a launch reports a CUDA error code instead of crashing
        rc = lib._lib.layercut_gptq_dequant(None, None, None, None, None, 4096, 4096, 4, 0, 0, None)
        with pytest.raises(LayercutError, match="CUDA error"):
            lib._check(rc, "gptq_dequant")


# ---------------------------------------------------------------- GPU kernels

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
SHAPES = ((576, 100), (4096, 44), (352, 1028), (1024, 4096))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs,act_order", [(-1, False), (32, False), (128, False), (128, True)])
def test_kernel_matches_reference(bits: int, gs: int, act_order: bool):
    for i, (in_f, out_f) in enumerate(SHAPES):
        packed, _, op_gs = make_layer(bits, in_f, out_f, gs, act_order, seed=i, device="cuda")
        for dtype in (torch.float16, torch.bfloat16):
            for batch in (1, 2, 3, 5, 8, 13, 16, 17, 64):
                x = torch.randn(batch, in_f, device="cuda").to(dtype)
                y = call_op(x, packed, bits, op_gs)
                ref = ops.reference_gptq_matmul(
                    x, *(packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")), bits
                )
                tol = 1e-2 if dtype is torch.float16 else 4e-2
                scale = ref.float().abs().max().item() + 1e-6
                torch.testing.assert_close(
                    y.float() / scale,
                    ref.float() / scale,
                    rtol=tol,
                    atol=tol,
                    msg=lambda m, b=batch, s=(in_f, out_f), d=dtype: f"{b} {s} {d}: {m}",
                )


@pytest.mark.gpu
@gpu
def test_kernel_split_k_is_repeatable_and_strided_input_ok():
    packed, _, op_gs = make_layer(4, 4096, 4096, 128, False, device="cuda")
    x = torch.randn(4096, 8, device="cuda", dtype=torch.float16).T  # non-contiguous [8, 4096]
    y1 = call_op(x, packed, 4, op_gs)
    y2 = call_op(x.contiguous(), packed, 4, op_gs)  # counters must have been reset by the last CTA
    assert torch.equal(y1, y2)  # fixed reduction order: deterministic


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", BITS)
def test_dequant_kernel_exact(bits: int):
    packed, w, _ = make_layer(bits, 576, 100, 64, True, device="cuda")
    lib = build.load_library()
    w_t = lib.dequantize_t(
        packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits, torch.float16
    )
    assert torch.equal(w_t, w.T.half())


@pytest.mark.gpu
@gpu
def test_op_compiles_on_cuda():
    packed, w, op_gs = make_layer(4, 1024, 256, 128, False, device="cuda")
    x = torch.randn(2, 1024, device="cuda", dtype=torch.float16)
    fn = torch.compile(lambda x: call_op(x, packed, 4, op_gs), fullgraph=True)
    torch.testing.assert_close(fn(x), call_op(x, packed, 4, op_gs))
