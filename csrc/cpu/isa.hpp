// What the per-instruction-set translation units share. CMake compiles matmul_isa.cpp,
// attention_isa.cpp and kernels_isa.cpp once per instruction set, defining CPU_ISA_SCALAR,
// _AVX2 or _AVX512 (plus CPU_ISA_AMX for the amx set: AVX-512 code, AMX-INT8 matmul tiles)
// and the matching -m flags; each copy lives in its own namespace (isa_scalar, isa_avx2,
// isa_avx512, isa_amx) and kernels_isa.cpp assembles that set's Kernels table.
// The SIMD code computes the canonical arithmetic of numerics.hpp and no other: exact integer
// block sums, then per (row, column) one fma chain over the blocks in order; reductions over 8
// lanes folded as hsum8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels.hpp"
#include "numerics.hpp"

#if defined(CPU_ISA_AVX2) || defined(CPU_ISA_AVX512)
#include <immintrin.h>
#define CPU_SIMD 1
#endif

#if defined(CPU_ISA_AMX)
#define ISA_NS isa_amx
#define ISA_NAME "amx"
#elif defined(CPU_ISA_AVX512)
#define ISA_NS isa_avx512
#define ISA_NAME "avx512"
#elif defined(CPU_ISA_AVX2)
#define ISA_NS isa_avx2
#define ISA_NAME "avx2"
#else
#define ISA_NS isa_scalar
#define ISA_NAME "scalar"
#endif

namespace cpu {
namespace ISA_NS {

// The table's matmul (matmul_isa.cpp) and attend_chunk (attention_isa.cpp).
void matmul(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo);
void attend_chunk(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd, const KvPages& kv,
                  int chunk, float* states, float* scratch);

namespace {

// f(std::integral_constant<int, N>{}) for a run-time n in [1, Max] (a kernel's row or head
// count, which sizes its register arrays).
template <int Max, typename F>
void with_constant(int n, F f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_constant<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// f(0), f(1), ..., f(N - 1), each index a compile-time constant.
template <int N, int I = 0, typename F>
void static_for(F f) {
  if constexpr (I < N) {
    f(std::integral_constant<int, I>{});
    static_for<N, I + 1>(f);
  }
}

}  // namespace

#ifdef CPU_SIMD
namespace {

inline __m256 exp8(__m256 x) {
  using namespace expc;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kMin)), _mm256_set1_ps(kMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hmax8(__m256 v) {  // max is exact in any order
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
}

inline float hsum8(__m256 v) {  // numerics.hpp's hsum8 fold
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

}  // namespace
#endif  // CPU_SIMD

}  // namespace ISA_NS
}  // namespace cpu
