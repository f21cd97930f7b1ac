// One instruction set's Kernels table (isa.hpp): its matmul and attention, and the
// elementwise kernels below.
#include <algorithm>
#include <cmath>
#include <limits>

#include "isa.hpp"

namespace cpu {
namespace ISA_NS {
namespace {

[[maybe_unused]] void merge_states_scalar(float* const* totals, const float* const* parts, int count, int hd) {
  for (int i = 0; i < count; ++i) merge_state(totals[i], parts[i], hd);
}

[[maybe_unused]] void silu_mul_scalar(const float* g, const float* u, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = silu_mul(g[i], u[i]);
}

[[maybe_unused]] void to_half_scalar(const float* x, int n, uint16_t* out, size_t stride) {
  for (int i = 0; i < n; ++i) out[i * stride] = float_to_half(x[i]);
}

[[maybe_unused]] void rms_norm_scalar(const float* x, const float* w, int n, float eps, float* out) {
  const float inverse = rms_inverse(dot_canonical(x, x, n), n, eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * inverse * w[i];
}

[[maybe_unused]] void quantize_row_scalar(const float* x, int k, int8_t* q, float* d, float* s, int32_t* sum) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < kBlock; ++j) {
      const float a = std::fabs(xb[j]);
      finite = finite && a <= std::numeric_limits<float>::max();
      amax = max_canonical(amax, a);
    }
    if (!finite) {
      quantize_non_finite(q + b * kBlock, d + b, s + b, sum + b);
      continue;
    }
    const float inverse = quant_inverse(amax);
    int isum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      isum += v;
    }
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(isum);
    sum[b] = isum;
  }
}

#ifdef CPU_SIMD
void rms_norm_simd(const float* x, const float* w, int n, float eps, float* out) {
  __m256 lanes = _mm256_setzero_ps();
  for (int i = 0; i < n; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    lanes = _mm256_fmadd_ps(v, v, lanes);
  }
  const __m256 inverse = _mm256_set1_ps(rms_inverse(hsum8(lanes), n, eps));
  for (int i = 0; i < n; i += kLanes)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inverse), _mm256_loadu_ps(w + i)));
}

void quantize_row_simd(const float* x, int k, int8_t* q, float* d, float* s, int32_t* sum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps(), non_finite = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + kLanes * i);
      const __m256 a = _mm256_and_ps(v[i], abs_mask);
      amax8 = _mm256_max_ps(amax8, a);  // max is exact in any order
      non_finite = _mm256_or_ps(non_finite, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // > max or NaN
    }
    if (_mm256_movemask_ps(non_finite) != 0) {
      quantize_non_finite(q + b * kBlock, d + b, s + b, sum + b);
      continue;
    }
    const float amax = hmax8(amax8);
    const __m256 inverse = _mm256_set1_ps(quant_inverse(amax));
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // round half even
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
    const int isum = _mm_cvtsi128_si32(t4) + _mm_extract_epi32(t4, 1);
    // int32 -> int8 in element order: packs interleave 128-bit lanes, the permute undoes it.
    const __m256i p16 = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p8);
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(isum);
    sum[b] = isum;
  }
}

// F16C's conversion rounds to nearest even, as float_to_half does (NaNs keep their top payload
// bits and become quiet; the kernel tests compare every path over all classes of values).
void to_half_simd(const float* x, int n, uint16_t* out, size_t stride) {
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (stride == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
      continue;
    }
    alignas(16) uint16_t lanes[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), h);
    for (int j = 0; j < kLanes; ++j) out[(i + j) * stride] = lanes[j];
  }
  for (; i < n; ++i) out[i * stride] = float_to_half(x[i]);
}

// merge_state for 8 pairs at a time: their rescales in one exp8 (exp_canonical lane for lane),
// then each pair's acc and l, as merge_state computes them.
void merge_states_simd(float* const* totals, const float* const* parts, int count, int hd) {
  for (int i0 = 0; i0 < count; i0 += kLanes) {
    const int n = std::min(kLanes, count - i0);
    alignas(32) float m_total[kLanes] = {}, m_part[kLanes] = {}, a[kLanes], b[kLanes], m[kLanes];
    for (int j = 0; j < n; ++j) {
      m_total[j] = totals[i0 + j][hd];
      m_part[j] = parts[i0 + j][hd];
    }
    const __m256 mt = _mm256_load_ps(m_total), mp = _mm256_load_ps(m_part), mm = _mm256_max_ps(mt, mp);
    _mm256_store_ps(m, mm);
    _mm256_store_ps(a, exp8(_mm256_sub_ps(mt, mm)));
    _mm256_store_ps(b, exp8(_mm256_sub_ps(mp, mm)));
    for (int j = 0; j < n; ++j) {
      if (!(m_part[j] > -INFINITY)) continue;  // an empty part
      float* total = totals[i0 + j];
      const float* part = parts[i0 + j];
      const __m256 av = _mm256_set1_ps(a[j]), bv = _mm256_set1_ps(b[j]);
      int d = 0;
      for (; d + kLanes <= hd; d += kLanes)
        _mm256_storeu_ps(total + d, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(total + d), av),
                                                  _mm256_mul_ps(_mm256_loadu_ps(part + d), bv)));
      for (; d < hd; ++d) total[d] = total[d] * a[j] + part[d] * b[j];
      total[hd + 1] = total[hd + 1] * a[j] + part[hd + 1] * b[j];
      total[hd] = m[j];
    }
  }
}

void silu_mul_simd(const float* g, const float* u, float* out, int n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_xor_ps(gv, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = silu_mul(g[i], u[i]);
}
#endif  // CPU_SIMD

}  // namespace

#ifdef CPU_SIMD
extern const Kernels kernels{ISA_NAME,     matmul,        attend_chunk,      merge_states_simd,
                             silu_mul_simd, rms_norm_simd, quantize_row_simd, to_half_simd};
#else
extern const Kernels kernels{ISA_NAME,        matmul,          attend_chunk,       merge_states_scalar,
                             silu_mul_scalar, rms_norm_scalar, quantize_row_scalar, to_half_scalar};
#endif

}  // namespace ISA_NS
}  // namespace cpu
