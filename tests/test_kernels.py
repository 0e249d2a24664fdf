"""layercut::gptq_matmul: reference maths, op registration, validation, kernel registry, nvcc
build, CUDA C kernels (the Triton kernels are tested in test_triton.py).

GPU tests (``-m gpu``) skip without CUDA; the compile test skips without nvcc (the first run
compiles for sm_80+sm_90, minutes on a small machine; later runs hit the cache).
"""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import torch
from gptq_codes import exact_sum_ok, random_codes, small_int_x

from layercut.compress.core.errors import LayercutError
from layercut.compress.kernels import build, ops
from layercut.compress.quant.format.pack import pack_gptq

BITS = (2, 3, 4, 8)
GROUP_SIZES = (-1, 32, 64, 128)
HAS_CUDA = torch.cuda.is_available()


def make_layer(
    bits: int, in_f: int, out_f: int, gs: int, act_order: bool, seed: int = 0, device: str = "cpu"
):
    """Packed GPTQ tensors on ``device``, the dense W [out, in] they encode, and the op's group size."""
    maxq = (1 << bits) - 1
    q, z, s, g_idx, w = random_codes(
        bits, in_f, out_f, gs, act_order, seed, zmin=0, scale=(1 / maxq, 0.5 / maxq)
    )
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
    """Integer x and power-of-two scales: the exact result is an fp32 number, so fp32
    accumulation gives exactly its rounding to ``dtype``. Accumulating in fp16/bf16 cannot:
    partial sums here reach ~10^5 in steps of 2^-7, far past their 11/8 significant bits."""
    q, z, s, g_idx, w = random_codes(8, 1024, 40, 64, seed=1, zmin=0, pow2_scales=(4, 6))
    packed = pack_gptq(q, z, s, g_idx, 8)
    x = small_int_x((5, 1024), seed=2)
    assert exact_sum_ok(x, (4, 6), 8)
    exact = (x.double() @ w.double().T).to(dtype)  # float64 holds these sums exactly
    y = call_op(x.to(dtype), packed, 8, 64)
    assert y.dtype == dtype and torch.equal(y, exact)
    half_acc = torch.zeros(5, 40, dtype=dtype)  # what accumulating in dtype would give
    for k in range(1024):
        half_acc = half_acc + x[:, k : k + 1].to(dtype) * w[:, k].to(dtype)
    assert not torch.equal(half_acc, exact)  # so this test can tell the two apart


# ---------------------------------------------------------------- validation (call time, clear errors)


def _bad_inputs():
    """(name, mutate(args) -> args, message) for each malformed call (in 128, out 16, 4 bits, g32)."""

    def with_(i, v):
        return lambda a: (*a[:i], v, *a[i + 1 :])

    i32, f16 = torch.int32, torch.float16
    return [
        ("x-features", with_(0, torch.randn(2, 64)), "g_idx has 128 entries, x has 64 features"),
        (
            "qweight-rows",
            with_(1, torch.zeros(12, 16, dtype=i32)),
            "qweight has 12 rows; 128 inputs at 4 bits need 16",
        ),
        ("qweight-dtype", lambda a: (a[0], a[1].long(), *a[2:]), "qweight must be int32"),
        ("scales-columns", with_(3, torch.ones(4, 15, dtype=f16)), "scales has 15 columns, qweight 16"),
        (
            "qzeros-columns",
            with_(2, torch.zeros(4, 3, dtype=i32)),
            "qzeros has 3 columns; 16 outputs at 4 bits need 2",
        ),
        ("group-count", with_(2, torch.zeros(3, 2, dtype=i32)), "disagree on the number of groups"),
        ("too-few-groups", lambda a: (*a[:2], a[2][:2], a[3][:2], a[4]), "need 4 scale rows"),
        ("g_idx-length", with_(4, torch.zeros(127, dtype=i32)), "g_idx has 127 entries, x has 128"),
        ("g_idx-dtype", with_(4, torch.zeros(128)), "g_idx must be int32 or int64"),
        ("g_idx-values", with_(4, torch.full((128,), 9, dtype=i32)), r"g_idx values must lie in \[0, 4\)"),
        ("x-float64", lambda a: (a[0].double(), *a[1:]), "x must be float16, bfloat16 or float32"),
        ("x-int", lambda a: (a[0].to(i32), *a[1:]), "x must be float16, bfloat16 or float32"),
        ("scales-float64", with_(3, torch.ones(4, 16, dtype=torch.float64)), "scales must be float16"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_op_refuses_malformed_calls(case):
    packed, _, _ = make_layer(4, 128, 16, 32, False)
    args = (torch.randn(2, 128), packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"])
    _, mutate, message = case
    with pytest.raises(LayercutError, match=message):
        torch.ops.layercut.gptq_matmul(*mutate(args), 4, 32)


@pytest.mark.parametrize(
    "bits,gs,message",
    [
        (5, 32, r"bits must be one of \(2, 3, 4, 8\), got 5"),
        (1, 32, "got 1"),
        (4, -2, "group_size must be -1, 0"),
    ],
)
def test_op_refuses_bad_bits_and_group_size(bits, gs, message):
    packed, _, _ = make_layer(4, 128, 16, 32, False)
    with pytest.raises(LayercutError, match=message):
        call_op(torch.randn(1, 128), packed, bits, gs)


def test_fake_impl_validates_too():
    """torch.compile / meta tensors get the same errors (the fake implementation checks too)."""
    packed, _, op_gs = make_layer(4, 128, 24, 32, False, device="meta")
    with pytest.raises(LayercutError, match="x has 64 features"):
        call_op(torch.empty(1, 64, device="meta"), packed, 4, op_gs)


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
        "import sys, layercut.compress.kernels.ops, layercut.compress.kernels.build, layercut.compress.quant.format.qlinear\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\nprint('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---------------------------------------------------------------- registry


def test_registry_selects_per_call(monkeypatch):
    """Preference CUDA C GEMV > Triton > CUDA C dequant+cuBLAS > reference, by each spec's
    ``supports`` and by what is installed (neither check imports triton or builds anything)."""
    monkeypatch.delenv("LAYERCUT_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(ops, "_cuda_library_available", lambda: True)
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    sel = ops.select_kernel
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float16) is ops.CUDA_GEMV
    assert sel(3, ops.ACT_ORDER, "cuda", 16, 4096, 11008, torch.bfloat16) is ops.CUDA_GEMV
    assert sel(2, -1, "cuda", 17, 576, 1536, torch.float16) is ops.TRITON  # prefill: fused Triton GEMM
    assert sel(4, 128, "cpu", 1, 4096, 4096, torch.float16) is ops.REFERENCE
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float32) is ops.TRITON  # CUDA C takes fp16/bf16 only
    assert sel(4, 16, "cuda", 1, 4096, 4096, torch.float16) is ops.TRITON  # group not a multiple of 32
    assert sel(4, 128, "cuda", 1, 100, 4096, torch.float16) is ops.TRITON  # in % 32 != 0
    assert sel(4, 128, "cuda", 1, 4096, 4098, torch.float16) is ops.TRITON  # out % 4 != 0
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    assert sel(2, -1, "cuda", 17, 576, 1536, torch.float16) is ops.CUDA_DEQUANT_MATMUL
    assert sel(4, 128, "cuda", 1, 100, 4096, torch.float16) is ops.REFERENCE
    assert ops.supports(8, 64, "cuda", 4) and not ops.supports(8, 64, "cpu", 4)
    assert not ops.supports(5, 64, "cuda", 4)
    monkeypatch.setattr(ops, "_cuda_library_available", lambda: False)
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float16) is ops.REFERENCE  # nothing installed
    with pytest.raises(LayercutError, match="LAYERCUT_KERNELS=cuda but the CUDA C library cannot be built"):
        monkeypatch.setenv("LAYERCUT_KERNELS", "cuda")
        sel(4, 128, "cuda", 1, 4096, 4096, torch.float16)
    monkeypatch.setenv("LAYERCUT_KERNELS", "reference")
    assert sel(4, 128, "cuda", 1, 4096, 4096, torch.float16) is ops.REFERENCE


def test_forced_family_never_falls_back(monkeypatch):
    monkeypatch.setattr(ops, "_cuda_library_available", lambda: True)
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setenv("LAYERCUT_KERNELS", "cuda")
    assert ops.select_kernel(4, 128, "cuda", 64, 4096, 4096, torch.float16) is ops.CUDA_DEQUANT_MATMUL
    with pytest.raises(LayercutError, match="cuda_gemv takes .*float32.*cuda_dequant_matmul"):
        ops.select_kernel(4, 128, "cuda", 1, 4096, 4096, torch.float32)
    monkeypatch.setenv("LAYERCUT_KERNELS", "triton")
    assert ops.select_kernel(4, 128, "cuda", 1, 4096, 4096, torch.float16) is ops.TRITON
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(LayercutError, match="CPU tensors need TRITON_INTERPRET=1"):
        ops.select_kernel(4, 128, "cpu", 1, 4096, 4096, torch.float16)


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
def test_kernel_matches_reference(bits: int, gs: int, act_order: bool, monkeypatch):
    """The CUDA C kernels (forced), bitwise on exact data (integer x, power-of-two scales: every
    sum is exact in fp32, see test_triton.py) for every shape, dtype and batch."""
    monkeypatch.setenv("LAYERCUT_KERNELS", "cuda")
    for i, (in_f, out_f) in enumerate(SHAPES):
        q, z, s, g_idx, _ = random_codes(bits, in_f, out_f, gs, act_order, seed=i, zmin=0, pow2_scales=(4, 6))
        packed = {k: v.cuda() for k, v in pack_gptq(q, z, s, g_idx, bits).items()}
        op_gs = ops.ACT_ORDER if act_order else gs
        for dtype in (torch.float16, torch.bfloat16):
            for batch in (1, 2, 3, 5, 8, 13, 16, 17, 64):
                x32 = small_int_x((batch, in_f), seed=batch, amp=2)
                assert exact_sum_ok(x32, (4, 6), bits)
                x = x32.cuda().to(dtype)
                y = call_op(x, packed, bits, op_gs)
                assert ops.last_kernel() == ("cuda_gemv" if batch <= 16 else "cuda_dequant_matmul")
                ref = ops.reference_gptq_matmul(
                    x, *(packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")), bits
                )
                bad = int((y != ref).sum())
                assert bad == 0, (
                    f"{bits}b gs={gs} act={act_order} {batch}x{in_f}->{out_f} {dtype}: {bad} differ"
                )


@pytest.mark.gpu
@gpu
def test_kernel_split_k_is_repeatable(monkeypatch):
    """Split-K partials are summed in a fixed order and the tile counters reset themselves:
    the same call twice gives the same bits (a stale counter would skip or double a reduction)."""
    monkeypatch.setenv("LAYERCUT_KERNELS", "cuda")
    packed, _, op_gs = make_layer(4, 4096, 4096, 128, False, device="cuda")
    x = torch.randn(8, 4096, device="cuda", dtype=torch.float16)
    y1 = call_op(x, packed, 4, op_gs)
    y2 = call_op(x, packed, 4, op_gs)
    assert ops.last_kernel() == "cuda_gemv" and torch.equal(y1, y2)


@pytest.mark.gpu
@gpu
def test_kernel_takes_views(monkeypatch):
    """Non-contiguous x and packed tensors that are views at odd offsets (the op copies what
    the kernels' vector loads cannot take) give the result of contiguous inputs."""
    monkeypatch.setenv("LAYERCUT_KERNELS", "cuda")
    packed, _, op_gs = make_layer(4, 1024, 260, 128, False, device="cuda")
    x = torch.randn(1024, 8, device="cuda", dtype=torch.float16).T  # [8, 1024], strides (1, 8)
    wide_q = torch.zeros(packed["qweight"].shape[0], 261, dtype=torch.int32, device="cuda")
    wide_q[:, 1:] = packed["qweight"]
    wide_s = torch.zeros(packed["scales"].shape[0], 261, dtype=torch.float16, device="cuda")
    wide_s[:, 1:] = packed["scales"]
    views = {**packed, "qweight": wide_q[:, 1:], "scales": wide_s[:, 1:]}  # misaligned column views
    y = call_op(x, views, 4, op_gs)
    assert ops.last_kernel() == "cuda_gemv"
    assert torch.equal(y, call_op(x.contiguous(), packed, 4, op_gs))


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
