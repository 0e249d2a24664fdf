#!/usr/bin/env bash
# One-shot GPU check of the layercut kernels: build (or reuse) the library, run the GPU tests,
# run the benchmark. Everything it produces goes to $OUT (default ./gpu_out).
#
#   bash scripts/gpu_check.sh                      # on a machine with a CUDA GPU and CUDA torch
#
# Saving device time: build the library beforehand on any machine with nvcc (no GPU needed)
#   python -m compress.kernels.build --out build/kernels
# and ship build/kernels with the checkout; it is used when present and working, else the
# script compiles with the device's nvcc. PYTHON selects the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

log "repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'); out $OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/summary.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "FATAL: $PY has no CUDA torch"; exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$OUT/summary.txt"
"$PY" -c "import pytest" 2>/dev/null || log "WARNING: pytest missing; tests will be skipped"

# ---- library: prebuilt if it works here, else compile with this machine's nvcc
smoke() {  # one GEMV through the op against the reference
  LAYERCUT_KERNEL_LIB="$1" "$PY" - <<'EOF'
import torch
from compress.kernels import ops
from compress.quant.pack import pack_gptq
q = torch.randint(0, 16, (256, 512), device="cuda"); z = torch.randint(1, 16, (4, 256), device="cuda")
s = torch.rand(4, 256, device="cuda") * 0.01; g = torch.arange(512, device="cuda") // 128
p = pack_gptq(q, z, s, g, 4); a = [p[k] for k in ("qweight", "qzeros", "scales", "g_idx")]
x = torch.randn(1, 512, device="cuda", dtype=torch.float16)
y = torch.ops.layercut.gptq_matmul(x, *a, 4, 128); torch.cuda.synchronize()
r = ops.reference_gptq_matmul(x, *a, 4)
err = ((y.float() - r.float()).abs().max() / r.float().abs().max()).item()
print(f"smoke: kernel={ops.select_kernel(4, 128, 'cuda', 1, 512, 256, x.dtype).name} rel_err={err:.2e}")
assert err < 1e-2
EOF
}
LIB=""
if [ -f build/kernels/liblayercut_kernels.so ] && smoke "$PWD/build/kernels/liblayercut_kernels.so" >> "$OUT/build.log" 2>&1; then
  LIB="$PWD/build/kernels/liblayercut_kernels.so"; log "using prebuilt $LIB"
else
  log "building kernels with nvcc (prebuilt absent or not working here; see build.log)"
  start=$(date +%s)
  if "$PY" -m compress.kernels.build --out "$OUT/build" >> "$OUT/build.log" 2>&1; then
    LIB="$OUT/build/liblayercut_kernels.so"; log "built in $(( $(date +%s) - start ))s"
    smoke "$LIB" >> "$OUT/build.log" 2>&1 || log "SMOKE FAILED with the fresh build (see build.log)"
  else
    log "BUILD FAILED (see build.log)"; tail -20 "$OUT/build.log" | tee -a "$OUT/summary.txt"
  fi
fi
tail -1 "$OUT/build.log" | tee -a "$OUT/summary.txt"
[ -n "$LIB" ] && export LAYERCUT_KERNEL_LIB="$LIB"

# ---- GPU tests
timeout 300 "$PY" -m pytest -m gpu tests/test_kernels.py -q -rA -p no:cacheprovider \
  --junitxml="$OUT/pytest_gpu.xml" > "$OUT/pytest_gpu.log" 2>&1
log "pytest -m gpu exit $?: $(tail -1 "$OUT/pytest_gpu.log")"

# ---- benchmark
timeout 300 "$PY" benchmarks/kernels.py --out "$OUT/kernels.json" --iters 100 > "$OUT/bench.log" 2>&1
log "benchmark exit $?"
cat "$OUT/bench.log" >> "$OUT/summary.txt"
rm -f "$OUT/build/"*.tmp 2>/dev/null
log "done"
