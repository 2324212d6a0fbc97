// Pairs of bfloat16 values as the AVX512-BF16 dot-product instruction (vdpbf16ps) takes them:
// each 32-bit lane holds two values, and the instruction adds a[2i] b[2i] + a[2i+1] b[2i+1] to
// float32 lane i. Shared by the kernels built on it; include only where __AVX512BF16__ is set.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace speedkv {

using bf16 = at::BFloat16;

inline __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// One pair (a 32-bit word) broadcast to every lane.
inline __m512bh pair_of(const bf16* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return as_pairs(_mm512_set1_epi32(word));
}

// 16 pairs from memory.
inline __m512bh load_pairs(const bf16* p) { return as_pairs(_mm512_loadu_si512(p)); }

// 16 floats rounded to bfloat16 (to nearest even) and stored.
inline void store_rounded(bf16* p, __m512 x) {
  __m256bh rounded = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i&>(rounded));
}

}  // namespace speedkv
