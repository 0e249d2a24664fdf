// GPTQ v1 dequantization to a dense W^T [in, out] in fp16/bf16, for batches too large for
// the GEMV: the caller then runs y = x @ W^T with cuBLAS (torch.matmul). W^T has qweight's
// orientation, so both the reads (one packed row) and the writes (one W^T row) are coalesced
// across the threads of a warp, which own consecutive output columns.
#include "gptq.h"

namespace layercut {
namespace {

constexpr int kDequantThreads = 256;

template <typename T, int BITS>
__global__ void __launch_bounds__(kDequantThreads)
gptq_dequant_kernel(const uint32_t* __restrict__ qweight,  // [in*BITS/32, out]
                    const uint32_t* __restrict__ qzeros,   // [groups, ceil(out*BITS/32)]
                    const __half* __restrict__ scales,     // [groups, out]
                    const int* __restrict__ g_idx,         // [in]
                    T* __restrict__ w_t,                   // [in, out]
                    int out_features) {
  const int c = blockIdx.x * kDequantThreads + threadIdx.x;
  const int block = blockIdx.y;  // 32-input block
  if (c >= out_features) return;
  const int zrow = (out_features * BITS + 31) / 32;
  uint32_t w[BITS];
#pragma unroll
  for (int r = 0; r < BITS; ++r) w[r] = __ldg(qweight + (size_t)(block * BITS + r) * out_features + c);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int i = block * 32 + j;
    const int g = __ldg(g_idx + i);
    const float s = __half2float(scales[(size_t)g * out_features + c]);
    const float z = (float)zero_point<BITS>(qzeros + (size_t)g * zrow, c);
    w_t[(size_t)i * out_features + c] = from_float<T>(s * (code_to_float(block_code<BITS>(w, j)) - z));
  }
}

template <typename T>
int launch_dequant(int bits, const void* qweight, const void* qzeros, const void* scales, const void* g_idx,
                   void* w_t, int in_features, int out_features, cudaStream_t stream) {
  const dim3 grid((out_features + kDequantThreads - 1) / kDequantThreads, in_features / 32);
  const auto* qw = static_cast<const uint32_t*>(qweight);
  const auto* qz = static_cast<const uint32_t*>(qzeros);
  const auto* sc = static_cast<const __half*>(scales);
  const auto* gi = static_cast<const int*>(g_idx);
  auto* out = static_cast<T*>(w_t);
  switch (bits) {
    case 2: gptq_dequant_kernel<T, 2><<<grid, kDequantThreads, 0, stream>>>(qw, qz, sc, gi, out, out_features); break;
    case 3: gptq_dequant_kernel<T, 3><<<grid, kDequantThreads, 0, stream>>>(qw, qz, sc, gi, out, out_features); break;
    case 4: gptq_dequant_kernel<T, 4><<<grid, kDequantThreads, 0, stream>>>(qw, qz, sc, gi, out, out_features); break;
    case 8: gptq_dequant_kernel<T, 8><<<grid, kDequantThreads, 0, stream>>>(qw, qz, sc, gi, out, out_features); break;
    default: return kBadBits;
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace layercut

using namespace layercut;

extern "C" {

// Bumped whenever an extern "C" signature changes; build.py checks it after loading.
int layercut_kernels_abi_version() { return 1; }

// w_t[i, o] = scales[g_idx[i], o] * (q[o, i] - zeros[g_idx[i], o]); w_t: [in, out] of dtype.
// Returns 0, a negative layercut::Status, or a cudaError_t.
int layercut_gptq_dequant(const void* qweight, const void* qzeros, const void* scales, const void* g_idx,
                          void* w_t, int in_features, int out_features, int bits, int dtype, int device,
                          void* stream) {
  if (in_features <= 0 || in_features % 32 || out_features <= 0) return kBadArgs;
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != device) cudaSetDevice(device);
  const auto st = static_cast<cudaStream_t>(stream);
  int rc;
  if (dtype == kFloat16) {
    rc = launch_dequant<__half>(bits, qweight, qzeros, scales, g_idx, w_t, in_features, out_features, st);
  } else if (dtype == kBFloat16) {
    rc = launch_dequant<__nv_bfloat16>(bits, qweight, qzeros, scales, g_idx, w_t, in_features, out_features, st);
  } else {
    rc = kBadDType;
  }
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
  return rc;
}

}  // extern "C"
