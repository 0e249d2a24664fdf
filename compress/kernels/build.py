"""Build the CUDA kernels with plain nvcc and bind them with ctypes.

Usage::

    python -m layercut.compress.kernels.build --out build/kernels         # compile (no GPU needed)
    LAYERCUT_KERNEL_LIB=build/kernels/liblayercut_kernels.so ...  # use a prebuilt library

Why not a torch C++/CUDA extension: building one needs a CUDA build of torch, and CI (and the
CPU machines the pipeline runs on) have CPU torch. The kernels therefore expose a small
``extern "C"`` API over raw device pointers, compiled by nvcc alone into a shared library
(cudart linked statically, so loading it needs no CUDA toolkit), and called here through
ctypes with the tensors' data pointers and torch's current CUDA stream.

Nothing here runs at import: the library is compiled on first use on a GPU machine and
cached under ``~/.cache/layercut/kernels/<hash of sources, archs and nvcc version>``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch
from torch import Tensor

from layercut.compress.core.errors import LayercutError

CSRC = Path(__file__).parent / "csrc"
LIB_NAME = "liblayercut_kernels.so"
DEFAULT_ARCHS = ("sm_80", "sm_90")
ABI_VERSION = 1  # must equal layercut_kernels_abi_version() in csrc/gptq_dequant.cu
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}  # layercut::DType in csrc/gptq.h
_STATUS = {-1: "bad arguments", -2: "unsupported bits", -3: "unsupported dtype"}


def find_nvcc() -> Path | None:
    """nvcc from $CUDA_HOME/$CUDA_PATH, then PATH, then /usr/local/cuda."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return Path(root) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.is_file() else None


def _require_nvcc() -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise LayercutError(
            "no nvcc found to build the layercut CUDA kernels: install the CUDA toolkit (or set "
            "CUDA_HOME), point LAYERCUT_KERNEL_LIB at a prebuilt liblayercut_kernels.so, or set "
            "LAYERCUT_KERNELS=reference to use the pure-torch path"
        )
    return nvcc


def sources() -> list[Path]:
    """The CUDA sources and headers that make up the library, in a fixed order."""
    return sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.h"))


def _gencode(archs: tuple[str, ...]) -> list[str]:
    flags = []
    for i, arch in enumerate(archs):
        num = arch.removeprefix("sm_")
        # the newest arch also ships PTX so newer GPUs can JIT it
        code = f"[sm_{num},compute_{num}]" if i == len(archs) - 1 else f"sm_{num}"
        flags += ["-gencode", f"arch=compute_{num},code={code}"]
    return flags


def compile_sources(out_dir: str | Path, archs: tuple[str, ...] = DEFAULT_ARCHS) -> Path:
    """Compile csrc/*.cu into ``out_dir/liblayercut_kernels.so`` for ``archs``; returns its path.

    Needs nvcc only (no GPU, no CUDA torch). Raises LayercutError if nvcc is missing or fails.
    """
    nvcc = _require_nvcc()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIB_NAME
    tmp = out_dir / f".{LIB_NAME}.{os.getpid()}.tmp"
    cmd = [
        str(nvcc), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
        "--threads", "0", "-lineinfo", *_gencode(tuple(archs)), "-o", str(tmp),
        *[str(p) for p in sources() if p.suffix == ".cu"],
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LayercutError(f"nvcc failed building the layercut kernels:\n{proc.stderr[-4000:]}")
    tmp.replace(lib)  # atomic: concurrent builders never see a half-written library
    return lib


def cache_key(archs: tuple[str, ...] = DEFAULT_ARCHS) -> str:
    """Hash of the sources, the archs and the nvcc version: the cache directory name."""
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(",".join(archs).encode())
    nvcc = find_nvcc()
    if nvcc is not None:
        h.update(subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("LAYERCUT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "layercut")
    return Path(base) / "kernels"


def build_library(archs: tuple[str, ...] = DEFAULT_ARCHS) -> Path:
    """The cached library for ``archs``, compiling it if absent."""
    lib = cache_dir() / cache_key(archs) / LIB_NAME
    if lib.is_file():
        return lib
    return compile_sources(lib.parent, archs)


class KernelLibrary:
    """ctypes binding of the extern "C" API in csrc/ (shapes are checked by the caller, ops.py)."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._lib.layercut_kernels_abi_version.restype = i32
        self._lib.layercut_gemv_plan.argtypes = [i32, i32, i32, i32, ctypes.POINTER(i32), ctypes.POINTER(i32)]
        self._lib.layercut_gemv_plan.restype = i32
        self._lib.layercut_gptq_gemv.argtypes = [ptr] * 8 + [i32] * 9 + [ptr]
        self._lib.layercut_gptq_gemv.restype = i32
        self._lib.layercut_gptq_dequant.argtypes = [ptr] * 5 + [i32] * 5 + [ptr]
        self._lib.layercut_gptq_dequant.restype = i32
        version = self._lib.layercut_kernels_abi_version()
        if version != ABI_VERSION:
            raise LayercutError(f"{path}: kernel ABI version {version}, expected {ABI_VERSION}; rebuild it")
        self._counters: dict[tuple[int, int], Tensor] = {}
        self._sm_count: dict[int, int] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            reason = _STATUS.get(rc, f"CUDA error {rc}")
            raise LayercutError(f"layercut kernel {what} failed: {reason}")

    def gemv_plan(self, batch: int, in_features: int, out_features: int, sm_count: int) -> tuple[int, int]:
        """(splits, k_chunk) the GEMV launches with; pure host code, callable without a GPU."""
        splits, k_chunk = ctypes.c_int(0), ctypes.c_int(0)
        rc = self._lib.layercut_gemv_plan(
            batch, in_features, out_features, sm_count, ctypes.byref(splits), ctypes.byref(k_chunk)
        )
        self._check(rc, "gemv_plan")
        return splits.value, k_chunk.value

    def gemv(
        self,
        x: Tensor,
        qweight: Tensor,
        qzeros: Tensor,
        scales: Tensor,
        g_idx: Tensor,
        bits: int,
        group_size: int,
    ) -> Tensor:
        """y [batch, out] = x [batch, in] @ W^T; group_size 0 = act-order (g_idx read per input)."""
        batch, in_features = x.shape
        out_features = qweight.shape[1]
        dev = x.device
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index not in self._sm_count:
            self._sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
        splits, k_chunk = self.gemv_plan(batch, in_features, out_features, self._sm_count[index])
        stream = torch.cuda.current_stream(dev)
        y = torch.empty(batch, out_features, dtype=x.dtype, device=dev)
        partial = counters = None
        if splits > 1:
            partial = torch.empty(splits, batch, out_features, dtype=torch.float32, device=dev)
            # counters are reset by the kernel itself, so one zeroed buffer per stream suffices
            tiles = (out_features + 127) // 128
            key = (index, stream.cuda_stream)
            if key not in self._counters or self._counters[key].numel() < tiles:
                self._counters[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=dev)
            counters = self._counters[key]
        rc = self._lib.layercut_gptq_gemv(
            x.data_ptr(),
            qweight.data_ptr(),
            qzeros.data_ptr(),
            scales.data_ptr(),
            g_idx.data_ptr(),
            partial.data_ptr() if partial is not None else None,
            counters.data_ptr() if counters is not None else None,
            y.data_ptr(),
            batch,
            in_features,
            out_features,
            bits,
            group_size,
            _DTYPE_CODES[x.dtype],
            splits,
            k_chunk,
            index,
            stream.cuda_stream,
        )
        self._check(rc, "gptq_gemv")
        return y

    def dequantize_t(
        self, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int, dtype: torch.dtype
    ) -> Tensor:
        """W^T [in, out] in ``dtype`` on qweight's device."""
        in_features, out_features = g_idx.shape[0], qweight.shape[1]
        dev = qweight.device
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        w_t = torch.empty(in_features, out_features, dtype=dtype, device=dev)
        stream = torch.cuda.current_stream(dev)
        rc = self._lib.layercut_gptq_dequant(
            qweight.data_ptr(),
            qzeros.data_ptr(),
            scales.data_ptr(),
            g_idx.data_ptr(),
            w_t.data_ptr(),
            in_features,
            out_features,
            bits,
            _DTYPE_CODES[dtype],
            index,
            stream.cuda_stream,
        )
        self._check(rc, "gptq_dequant")
        return w_t


_LOCK = threading.Lock()
_LOADED: KernelLibrary | None = None


def load_library() -> KernelLibrary:
    """The bound kernel library: $LAYERCUT_KERNEL_LIB if set, else the cached build (built if absent)."""
    global _LOADED
    with _LOCK:
        if _LOADED is None:
            prebuilt = os.environ.get("LAYERCUT_KERNEL_LIB")
            if prebuilt and not Path(prebuilt).is_file():
                raise LayercutError(f"LAYERCUT_KERNEL_LIB={prebuilt} does not exist")
            _LOADED = KernelLibrary(Path(prebuilt) if prebuilt else build_library())
        return _LOADED


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compile the layercut CUDA kernels with nvcc.")
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    parser.add_argument("--arch", action="append", help="e.g. sm_90 (repeatable; default sm_80 and sm_90)")
    args = parser.parse_args(argv)
    archs = tuple(args.arch) if args.arch else DEFAULT_ARCHS
    lib = compile_sources(args.out, archs) if args.out else build_library(archs)
    print(lib)


if __name__ == "__main__":
    main()
