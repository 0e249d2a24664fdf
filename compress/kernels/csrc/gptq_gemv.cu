// GPTQ v1 GEMV for decode-sized batches (1..16): y[b, o] = sum_i x[b, i] * W[o, i],
// W dequantized in registers straight from qweight/qzeros/scales/g_idx.
//
// Decode is memory-bound, so the kernel is shaped to keep HBM busy:
//  * each thread owns 4 adjacent output columns and reads qweight with 128-bit loads
//    (one int4 = 4 columns of one packed row); a 32-input block is BITS such loads;
//  * a CTA covers 128 columns x k_chunk inputs; its 4 warps stride over the chunk's
//    32-input blocks; the grid splits K ("split-K") so that ~4 CTAs per SM are in flight;
//  * codes become floats without I2F (code_to_float), and for static groups the dot
//    product is factored as s * (sum x*q - z * sum x), so the inner loop is one FMA per
//    weight and batch row;
//  * split-K partials (fp32) go to a workspace; the last CTA of a column tile (atomic
//    counter) sums them in a fixed order and writes y, so one launch does everything and
//    results are deterministic.
// Accumulation is fp32 throughout; x and y are fp16 or bf16.
#include "gptq.h"

namespace layercut {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kColsPerThread = 4;
constexpr int kTileN = 32 * kColsPerThread;  // 128 output columns per CTA

// Most inputs one CTA stages in shared memory for a given padded batch (<= 32 KiB of fp32).
__host__ __device__ constexpr int max_k_chunk(int maxb) { return (8192 / maxb) < 2048 ? 8192 / maxb : 2048; }

__device__ __forceinline__ void load_scales4(const __half* __restrict__ p, float (&s)[4]) {
  // 4 fp16 scales of adjacent columns: one 8-byte load (col % 4 == 0 and out % 4 == 0)
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  const __half2 lo = *reinterpret_cast<const __half2*>(&raw.x);
  const __half2 hi = *reinterpret_cast<const __half2*>(&raw.y);
  s[0] = __low2float(lo); s[1] = __high2float(lo);
  s[2] = __low2float(hi); s[3] = __high2float(hi);
}

template <typename T, int BITS, int MAXB, bool ACT_ORDER>
__global__ void __launch_bounds__(kThreads)
gptq_gemv_kernel(const T* __restrict__ x,               // [batch, in]
                 const int4* __restrict__ qweight,      // [in*BITS/32, out/4]
                 const uint32_t* __restrict__ qzeros,   // [groups, ceil(out*BITS/32)]
                 const __half* __restrict__ scales,     // [groups, out]
                 const int* __restrict__ g_idx,         // [in] (read only under ACT_ORDER)
                 float* __restrict__ partial,           // [splits, batch, out] (splits > 1)
                 unsigned* __restrict__ counters,       // [col_tiles], zero in and out
                 T* __restrict__ y,                     // [batch, out]
                 int batch, int in_features, int out_features, int group_size, int k_chunk) {
  __shared__ float xs[MAXB * max_k_chunk(MAXB)];  // x[:, chunk] as fp32, [MAXB][k_chunk]
  __shared__ float red[MAXB][kTileN];             // cross-warp reduction of the tile
  __shared__ bool is_last;

  const int tid = threadIdx.x + 32 * threadIdx.y;
  const int split = blockIdx.y;
  const int k_begin = split * k_chunk;
  const int k_end = min(in_features, k_begin + k_chunk);
  const int k_len = k_end - k_begin;
  const int tile_col0 = blockIdx.x * kTileN;
  const int col0 = tile_col0 + threadIdx.x * kColsPerThread;

  // rows b >= batch are staged as zeros, so the inner loops need no batch guards
  for (int i = tid; i < MAXB * k_chunk; i += kThreads) {
    const int b = i / k_chunk, k = i - b * k_chunk;
    xs[i] = (b < batch && k < k_len) ? to_float(x[(size_t)b * in_features + k_begin + k]) : 0.f;
  }
  for (int i = tid; i < MAXB * kTileN; i += kThreads) (&red[0][0])[i] = 0.f;
  __syncthreads();

  float acc[MAXB][kColsPerThread];
#pragma unroll
  for (int b = 0; b < MAXB; ++b)
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) acc[b][c] = 0.f;

  if (col0 < out_features) {
    const int n4 = out_features / 4;                 // qweight row length in int4
    const int zrow = (out_features * BITS + 31) / 32;  // qzeros row length in words
    for (int kb = k_begin + 32 * threadIdx.y; kb < k_end; kb += 32 * kWarps) {
      const int4* src = qweight + (size_t)(kb / 32) * BITS * n4 + col0 / 4;
      uint32_t w[kColsPerThread][BITS];  // [column][word of the 32-code block]
#pragma unroll
      for (int r = 0; r < BITS; ++r) {
        const int4 v = __ldg(src + (size_t)r * n4);
        w[0][r] = v.x; w[1][r] = v.y; w[2][r] = v.z; w[3][r] = v.w;
      }
      const float* xk = xs + (kb - k_begin);
      if constexpr (!ACT_ORDER) {
        // a 32-input block lies in one group (group_size % 32 == 0, checked on the host)
        const int g = kb / group_size;
        float s[4], z[4];
        load_scales4(scales + (size_t)g * out_features + col0, s);
#pragma unroll
        for (int c = 0; c < kColsPerThread; ++c)
          z[c] = (float)zero_point<BITS>(qzeros + (size_t)g * zrow, col0 + c);
        float dot[MAXB][kColsPerThread], xsum[MAXB];
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
          xsum[b] = 0.f;
#pragma unroll
          for (int c = 0; c < kColsPerThread; ++c) dot[b][c] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          float q[kColsPerThread];
#pragma unroll
          for (int c = 0; c < kColsPerThread; ++c) q[c] = code_to_float(block_code<BITS>(w[c], j));
#pragma unroll
          for (int b = 0; b < MAXB; ++b) {
            const float xv = xk[b * k_chunk + j];
            xsum[b] += xv;
#pragma unroll
            for (int c = 0; c < kColsPerThread; ++c) dot[b][c] = fmaf(xv, q[c], dot[b][c]);
          }
        }
#pragma unroll
        for (int b = 0; b < MAXB; ++b)
#pragma unroll
          for (int c = 0; c < kColsPerThread; ++c)
            acc[b][c] = fmaf(s[c], dot[b][c] - z[c] * xsum[b], acc[b][c]);
      } else {
        // act-order: every input may have its own group, so dequantize each weight
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int g = __ldg(g_idx + kb + j);
          float s[4], wv[kColsPerThread];
          load_scales4(scales + (size_t)g * out_features + col0, s);
#pragma unroll
          for (int c = 0; c < kColsPerThread; ++c) {
            const float z = (float)zero_point<BITS>(qzeros + (size_t)g * zrow, col0 + c);
            wv[c] = s[c] * (code_to_float(block_code<BITS>(w[c], j)) - z);
          }
#pragma unroll
          for (int b = 0; b < MAXB; ++b) {
            const float xv = xk[b * k_chunk + j];
#pragma unroll
            for (int c = 0; c < kColsPerThread; ++c) acc[b][c] = fmaf(xv, wv[c], acc[b][c]);
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
      if (b >= batch) break;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) atomicAdd(&red[b][threadIdx.x * kColsPerThread + c], acc[b][c]);
    }
  }
  __syncthreads();

  const int ncols = min(kTileN, out_features - tile_col0);
  if (gridDim.y == 1) {
    for (int i = tid; i < batch * kTileN; i += kThreads) {
      const int b = i / kTileN, c = i - b * kTileN;
      if (c < ncols) y[(size_t)b * out_features + tile_col0 + c] = from_float<T>(red[b][c]);
    }
    return;
  }

  // split-K: publish this split's partial tile, then the last CTA of the tile reduces
  float* mine = partial + (size_t)split * batch * out_features;
  for (int i = tid; i < batch * kTileN; i += kThreads) {
    const int b = i / kTileN, c = i - b * kTileN;
    if (c < ncols) mine[(size_t)b * out_features + tile_col0 + c] = red[b][c];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = tid; i < batch * kTileN; i += kThreads) {
    const int b = i / kTileN, c = i - b * kTileN;
    if (c >= ncols) continue;
    const size_t off = (size_t)b * out_features + tile_col0 + c;
    float sum = 0.f;
    for (int s = 0; s < (int)gridDim.y; ++s) sum += __ldcg(partial + (size_t)s * batch * out_features + off);
    y[off] = from_float<T>(sum);
  }
  if (tid == 0) counters[blockIdx.x] = 0u;  // ready for the next launch on this stream
}

int padded_batch(int batch) { return batch <= 1 ? 1 : batch <= 2 ? 2 : batch <= 4 ? 4 : batch <= 8 ? 8 : 16; }

template <typename T, int BITS, int MAXB>
cudaError_t launch_gemv(const void* x, const void* qweight, const void* qzeros, const void* scales,
                        const void* g_idx, void* partial, void* counters, void* y, int batch, int in,
                        int out, int group_size, int splits, int k_chunk, cudaStream_t stream) {
  const dim3 grid((out + kTileN - 1) / kTileN, splits);
  const dim3 block(32, kWarps);
  const auto* xp = static_cast<const T*>(x);
  const auto* qw = static_cast<const int4*>(qweight);
  const auto* qz = static_cast<const uint32_t*>(qzeros);
  const auto* sc = static_cast<const __half*>(scales);
  const auto* gi = static_cast<const int*>(g_idx);
  auto* pa = static_cast<float*>(partial);
  auto* co = static_cast<unsigned*>(counters);
  auto* yp = static_cast<T*>(y);
  if (group_size == 0) {
    gptq_gemv_kernel<T, BITS, MAXB, true><<<grid, block, 0, stream>>>(xp, qw, qz, sc, gi, pa, co, yp, batch, in,
                                                                      out, 32, k_chunk);
  } else {
    gptq_gemv_kernel<T, BITS, MAXB, false><<<grid, block, 0, stream>>>(xp, qw, qz, sc, gi, pa, co, yp, batch,
                                                                       in, out, group_size, k_chunk);
  }
  return cudaGetLastError();
}

template <typename T, int BITS>
cudaError_t dispatch_batch(int maxb, const void* x, const void* qw, const void* qz, const void* sc,
                           const void* gi, void* pa, void* co, void* y, int batch, int in, int out, int gs,
                           int splits, int k_chunk, cudaStream_t st) {
  switch (maxb) {
    case 1: return launch_gemv<T, BITS, 1>(x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    case 2: return launch_gemv<T, BITS, 2>(x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    case 4: return launch_gemv<T, BITS, 4>(x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    case 8: return launch_gemv<T, BITS, 8>(x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    default: return launch_gemv<T, BITS, 16>(x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
  }
}

template <typename T>
int dispatch_bits(int bits, int maxb, const void* x, const void* qw, const void* qz, const void* sc,
                  const void* gi, void* pa, void* co, void* y, int batch, int in, int out, int gs, int splits,
                  int k_chunk, cudaStream_t st) {
  switch (bits) {
    case 2: return dispatch_batch<T, 2>(maxb, x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    case 3: return dispatch_batch<T, 3>(maxb, x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    case 4: return dispatch_batch<T, 4>(maxb, x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    case 8: return dispatch_batch<T, 8>(maxb, x, qw, qz, sc, gi, pa, co, y, batch, in, out, gs, splits, k_chunk, st);
    default: return kBadBits;
  }
}

}  // namespace
}  // namespace layercut

using namespace layercut;

extern "C" {

// Launch shape for a GEMV: how many K splits and how many inputs each covers.
// Aims at ~4 CTAs per SM; each CTA stages at most max_k_chunk(padded batch) inputs.
int layercut_gemv_plan(int batch, int in_features, int out_features, int sm_count, int* splits, int* k_chunk) {
  if (batch < 1 || batch > 16 || in_features <= 0 || in_features % 32 || out_features <= 0 || sm_count <= 0)
    return kBadArgs;
  const int blocks = in_features / 32;
  const int col_tiles = (out_features + kTileN - 1) / kTileN;
  const int want = (4 * sm_count + col_tiles - 1) / col_tiles;
  int chunk = (blocks + want - 1) / want;
  chunk = max(chunk, min(kWarps, blocks));
  chunk = min(chunk, max_k_chunk(padded_batch(batch)) / 32);
  *k_chunk = chunk * 32;
  *splits = (blocks + chunk - 1) / chunk;
  return kOk;
}

// y = x @ W^T for a GPTQ v1 weight. group_size: > 0 static groups (multiple of 32),
// -1 one group, 0 act-order (g_idx read per input). partial: fp32 [splits, batch, out]
// (unused when splits == 1); counters: uint32 [ceil(out/128)], zeroed once, left zeroed.
// Returns 0, a negative layercut::Status, or a cudaError_t.
int layercut_gptq_gemv(const void* x, const void* qweight, const void* qzeros, const void* scales,
                       const void* g_idx, void* partial, void* counters, void* y, int batch, int in_features,
                       int out_features, int bits, int group_size, int dtype, int splits, int k_chunk,
                       int device, void* stream) {
  if (batch < 1 || batch > 16 || in_features % 32 || out_features % 4 || k_chunk % 32 || k_chunk <= 0 ||
      k_chunk > max_k_chunk(padded_batch(batch)) || (long long)splits * k_chunk < in_features ||
      (splits > 1 && (partial == nullptr || counters == nullptr)))
    return kBadArgs;
  if (group_size == -1) group_size = in_features;
  if (group_size < 0 || group_size % 32) return kBadArgs;
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != device) cudaSetDevice(device);
  const int maxb = padded_batch(batch);
  const auto st = static_cast<cudaStream_t>(stream);
  int rc;
  if (dtype == kFloat16) {
    rc = dispatch_bits<__half>(bits, maxb, x, qweight, qzeros, scales, g_idx, partial, counters, y, batch,
                               in_features, out_features, group_size, splits, k_chunk, st);
  } else if (dtype == kBFloat16) {
    rc = dispatch_bits<__nv_bfloat16>(bits, maxb, x, qweight, qzeros, scales, g_idx, partial, counters, y, batch,
                                      in_features, out_features, group_size, splits, k_chunk, st);
  } else {
    rc = kBadDType;
  }
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
  return rc;
}

}  // extern "C"
