// Shared helpers for the GPTQ v1 kernels (see compress/quant/pack.py for the format).
//
// qweight: [in*BITS/32, out] int32. Each output column holds its codes as a little-endian
//          bit stream: code i at bit i*BITS. 32 codes fill exactly BITS words, so a
//          "block" of 32 inputs is BITS consecutive rows (3 bits included).
// qzeros:  [groups, out*BITS/32] int32, the same stream along out, storing zero-1 (v1).
//          GPTQModel applies the -1 as a packed-word subtraction for 2/4/8 bits and per
//          field (mod 8) for 3 bits; zero_point() undoes it the same way.
// scales:  [groups, out] fp16.   g_idx: [in] int32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace layercut {

// dtype codes, kept in sync with compress/kernels/build.py
enum DType : int { kFloat16 = 0, kBFloat16 = 1 };

// Error codes returned by the extern "C" entry points (besides cudaError_t values > 0).
enum Status : int { kOk = 0, kBadArgs = -1, kBadBits = -2, kBadDType = -3 };

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Exact float of a code < 2^23 without I2F (a quarter-rate instruction on sm_80/sm_90):
// OR the code into the mantissa of 2^23, then subtract 2^23.
__device__ __forceinline__ float code_to_float(uint32_t code) {
  return __uint_as_float(code | 0x4B000000u) - 8388608.0f;
}

// Code j (0..31) of a 32-code block held in BITS words w[0..BITS-1].
// Called with j a compile-time constant after unrolling, so word/shift fold away.
template <int BITS>
__device__ __forceinline__ uint32_t block_code(const uint32_t (&w)[BITS], int j) {
  const int bit = j * BITS;
  const int word = bit >> 5;
  const int shift = bit & 31;
  uint32_t v = w[word] >> shift;
  if (BITS == 3 && shift > 29) {  // 3-bit codes 10 and 21 straddle two words
    v |= w[word + 1 < BITS ? word + 1 : BITS - 1] << (32 - shift);
  }
  return v & ((1u << BITS) - 1u);
}

// A word with 1 in every BITS-wide field: 0x55555555, 0x11111111, 0x01010101.
template <int BITS> struct OnesPattern;
template <> struct OnesPattern<2> { static constexpr uint32_t value = 0x55555555u; };
template <> struct OnesPattern<4> { static constexpr uint32_t value = 0x11111111u; };
template <> struct OnesPattern<8> { static constexpr uint32_t value = 0x01010101u; };

// True zero point of output column c from one group's row of qzeros (v1, offset undone).
template <int BITS>
__device__ __forceinline__ uint32_t zero_point(const uint32_t* __restrict__ qzeros_row, int c) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  if constexpr (BITS == 3) {
    const int bit = c * 3;
    const int word = bit >> 5;
    const int shift = bit & 31;
    uint32_t v = __ldg(qzeros_row + word) >> shift;
    if (shift > 29) v |= __ldg(qzeros_row + word + 1) << (32 - shift);
    return (v + 1u) & mask;  // per-field offset, mod 8
  } else {
    constexpr int per_word = 32 / BITS;
    // add 1 to every field of the word, carries included: the exact inverse of GPTQModel's
    // packed-word subtraction (uint32 arithmetic wraps like its int32 one)
    const uint32_t w = __ldg(qzeros_row + c / per_word) + OnesPattern<BITS>::value;
    return (w >> ((c % per_word) * BITS)) & mask;
  }
}

}  // namespace layercut
