#!/usr/bin/env bash
# One-shot GPU check of the layercut kernels, under 6 minutes with a prebuilt library (every
# stage has a timeout: 130 + 50 + 50 + 100 s, plus ~20 s of setup): the CUDA C library (prebuilt or
# built here), the Triton tests compiled natively, the CUDA C tests, the GPU quantize-and-load
# test, then the benchmark (Triton, CUDA C and fp16 side by side). Everything it produces goes
# to $OUT (default ./gpu_out); summary.txt has one line per stage.
#
#   bash scripts/gpu_check.sh                      # on a machine with a CUDA GPU, CUDA torch and triton
#
# The kernel tests and the benchmark import only torch, triton, numpy and safetensors (plus
# pytest), so a bare GPU machine with its own, older, torch and triton runs them. Save device
# time by preparing, on any machine with nvcc (no GPU needed), and shipping with the checkout:
#   python -m layercut.compress.kernels.build --out build/kernels          # the CUDA C library
#   python -m pip install --target build/pydeps pytest            # only if the GPU machine lacks pytest
# The prebuilt library is used when its smoke test passes there, else the device's nvcc builds
# one. The quantize-and-load test also needs transformers/accelerate/tokenizers; without them it
# is reported as not run. PYTHON selects the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET LAYERCUT_KERNELS  # native kernels, automatic routing unless a stage forces one
T0=$(date +%s)
log() { echo "[gpu_check $(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }

log "repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'); out $OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/summary.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "FATAL: $PY has no CUDA torch"; exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$OUT/summary.txt"
"$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
if ! "$PY" -c "import pytest" 2>/dev/null; then
  if [ -d build/pydeps ]; then export PYTHONPATH="$PYTHONPATH:$PWD/build/pydeps"; log "pytest from build/pydeps"; fi
  "$PY" -c "import pytest" 2>/dev/null || log "WARNING: no pytest; the test stages will fail"
fi

# ---- CUDA C library: prebuilt if it works here, else compile with this machine's nvcc
smoke() {  # one GEMV through the CUDA C kernel against the reference
  LAYERCUT_KERNEL_LIB="$1" LAYERCUT_KERNELS=cuda "$PY" - <<'EOF'
import torch
from layercut.compress.kernels import ops
from layercut.compress.quant.format.pack import pack_gptq
q = torch.randint(0, 16, (256, 512), device="cuda"); z = torch.randint(1, 16, (4, 256), device="cuda")
s = torch.rand(4, 256, device="cuda") * 0.01; g = torch.arange(512, device="cuda") // 128
p = pack_gptq(q, z, s, g, 4); a = [p[k] for k in ("qweight", "qzeros", "scales", "g_idx")]
x = torch.randn(1, 512, device="cuda", dtype=torch.float16)
y = torch.ops.layercut.gptq_matmul(x, *a, 4, 128); torch.cuda.synchronize()
r = ops.reference_gptq_matmul(x, *a, 4)
err = ((y.float() - r.float()).abs().max() / r.float().abs().max()).item()
print(f"smoke: kernel={ops.last_kernel()} rel_err={err:.2e}")
assert ops.last_kernel() == "cuda_gemv" and err < 1e-2
EOF
}
LIB=""
if [ -f build/kernels/liblayercut_kernels.so ] && smoke "$PWD/build/kernels/liblayercut_kernels.so" >> "$OUT/build.log" 2>&1; then
  LIB="$PWD/build/kernels/liblayercut_kernels.so"; log "using prebuilt $LIB"
else
  log "building kernels with nvcc (prebuilt absent or not working here; see build.log)"
  start=$(date +%s)
  if timeout 150 "$PY" -m layercut.compress.kernels.build --out "$OUT/build" >> "$OUT/build.log" 2>&1; then
    LIB="$OUT/build/liblayercut_kernels.so"; log "built in $(( $(date +%s) - start ))s"
    smoke "$LIB" >> "$OUT/build.log" 2>&1 || log "SMOKE FAILED with the fresh build (see build.log)"
  else
    log "BUILD FAILED (see build.log)"; tail -20 "$OUT/build.log" | tee -a "$OUT/summary.txt"
  fi
fi
tail -1 "$OUT/build.log" | tee -a "$OUT/summary.txt"
[ -n "$LIB" ] && export LAYERCUT_KERNEL_LIB="$LIB"

run_pytest() {  # name, timeout, pytest args...: junit XML + log per stage, one summary line
  local name="$1" limit="$2"; shift 2
  timeout "$limit" "$PY" -m pytest -q -rA -p no:cacheprovider --junitxml="$OUT/pytest_$name.xml" "$@" \
    > "$OUT/pytest_$name.log" 2>&1
  local rc=$?
  log "pytest $name exit $rc$([ $rc = 124 ] && echo ' (TIMEOUT)'): $(tail -1 "$OUT/pytest_$name.log")"
}

# ---- tests: Triton compiled for this GPU (first config per case: one compile each), CUDA C
run_pytest triton 130 -m gpu tests/test_triton.py
run_pytest cuda_c 50 -m gpu tests/test_kernels.py
if "$PY" -c "import transformers, accelerate, tokenizers" 2>/dev/null; then
  run_pytest quantize 50 -m gpu tests/test_quantize.py
else
  log "NOT RUN: tests/test_quantize.py -m gpu (transformers/accelerate/tokenizers not installed here)"
fi

# ---- benchmark: Triton vs CUDA C vs fp16, Llama-7B and -70B shapes, batch 1/4/16/512, 4-bit g128
timeout 100 "$PY" benchmarks/kernel_speed.py --out "$OUT/kernels.json" > "$OUT/bench.log" 2>&1
rc=$?
log "benchmark exit $rc$([ $rc = 124 ] && echo ' (TIMEOUT)')"
grep -E "^(device|block|goal)" "$OUT/bench.log" >> "$OUT/summary.txt"
rm -f "$OUT/build/"*.tmp 2>/dev/null
log "done"
