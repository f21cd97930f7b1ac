// The hot kernels, compiled once per instruction set (CMake sets CPU_ISA_SCALAR, _AVX2 or
// _AVX512 and the matching -m flags). The SIMD code computes the canonical arithmetic of
// numerics.hpp and no other: exact integer block sums, then per (row, column) one fma chain
// over the blocks in order; reductions over 8 lanes folded as hsum8.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.hpp"
#include "numerics.hpp"

#if defined(CPU_ISA_AVX2) || defined(CPU_ISA_AVX512)
#include <immintrin.h>
#define CPU_SIMD 1
#endif

#if defined(CPU_ISA_AVX512)
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
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- scalar reference of every kernel (also the whole scalar path) -------------------------

// Column c's exact integer dot product with one activation block, from a group block.
[[maybe_unused]] int block_isum(WeightType type, const uint8_t* blk, int c, const int8_t* aq) {
  int isum = 0;
  if (type == WeightType::Q4_1) {
    const uint8_t* qs = blk + 32;
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) {
        const uint8_t byte = qs[32 * i + 4 * c + e];
        isum += (byte & 0x0F) * aq[4 * i + e] + (byte >> 4) * aq[16 + 4 * i + e];
      }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 16);
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e) isum += qs[32 * j + 4 * c + e] * aq[4 * j + e];
  }
  return isum;
}

[[maybe_unused]] void matmul_scalar(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out,
                                    size_t ldo) {
  const int nb = w.k / kBlock;
  const size_t gbb = group_block_bytes(w.type);
  for (int g = g0; g < g1; ++g) {
    const uint8_t* group = w.data + static_cast<size_t>(g) * nb * gbb;
    for (int m = 0; m < rows; ++m) {
      float acc[kGroupCols] = {};
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = group + b * gbb;
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk);
        const int8_t* aq = a.q + static_cast<size_t>(m) * a.k + b * kBlock;
        const float da = a.d[static_cast<size_t>(m) * nb + b];
        const float sa = a.s[static_cast<size_t>(m) * nb + b];
        for (int c = 0; c < kGroupCols; ++c) {
          const float ds = half_to_float(scales[c]) * da;
          acc[c] = std::fma(ds, static_cast<float>(block_isum(w.type, blk, c, aq)), acc[c]);
          if (w.type == WeightType::Q4_1) acc[c] = std::fma(half_to_float(scales[kGroupCols + c]), sa, acc[c]);
        }
      }
      for (int c = 0; c < kGroupCols; ++c) out[static_cast<size_t>(m) * ldo + g * kGroupCols + c] = acc[c];
    }
  }
}

// The attention scratch: one K/V block as floats (K transposed), then the running state.
struct AttendScratch {
  float* kt;   // [hd][kBlock]: K^T of the block, zero past its last position
  float* vf;   // [kBlock][hd]
  float* acc;  // [rows][group][hd]
  float* m;    // [rows][group] running max
  float* l;    // [rows][group] running sum
  float* s;    // [2][kBlock] scores, then probabilities, of up to two heads
  AttendScratch(float* p, int rows, int group, int hd)
      : kt(p), vf(kt + kBlock * hd), acc(vf + kBlock * hd), m(acc + rows * group * hd), l(m + rows * group),
        s(l + rows * group) {}
};

// Positions [j0, j0 + nb) of K and V as floats (exact). K is stored in blocks of 32
// positions transposed ([hd][32] per block), so both copies are contiguous conversions.
// A last block's positions past nb were never written (the cache is not initialised): zero
// their K lanes so no stray bit pattern (a NaN, a slow denormal) enters the arithmetic.
void clear_unwritten(int nb, int hd, AttendScratch& st) {
  if (nb == kBlock) return;
  for (int d = 0; d < hd; ++d) std::fill(st.kt + d * kBlock + nb, st.kt + (d + 1) * kBlock, 0.0f);
}

[[maybe_unused]] void load_block_scalar(const uint16_t* k, const uint16_t* v, int j0, int nb, int hd, AttendScratch& st) {
  const uint16_t* kb = k + static_cast<size_t>(j0) * hd;
  for (int i = 0; i < kBlock * hd; ++i) st.kt[i] = half_to_float(kb[i]);
  clear_unwritten(nb, hd, st);
  for (int i = 0; i < nb * hd; ++i) st.vf[i] = half_to_float(v[static_cast<size_t>(j0) * hd + i]);
}

// The online-softmax step of one (row, head) for a block whose scores are in s[0, nb):
// rescale by exp(m_old - m_new), add exp(s - m_new) and its weighted V rows in order.
template <typename Exp, typename Accumulate>
void softmax_block(float* s, int nb, float& m, float& l, Exp exp_scores, Accumulate accumulate) {
  float block_max = kNegInf;
  for (int j = 0; j < nb; ++j) block_max = max_canonical(block_max, s[j]);
  const float m_new = max_canonical(m, block_max);
  const float alpha = m == kNegInf ? 0.0f : exp_canonical(m - m_new);
  exp_scores(s, nb, m_new);
  float block_sum = 0.0f;
  for (int j = 0; j < nb; ++j) block_sum += s[j];
  l = l * alpha + block_sum;
  m = m_new;
  accumulate(alpha);
}

// The block loop shared by every path; `scores(q_row, h, heads, st)` fills st.s for
// `heads` (1 or 2) heads starting at h, `exp_scores` and `accumulate_v` do the rest.
template <typename LoadBlock, typename Scores, typename ExpScores, typename AccumulateV>
void attend_blocks(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                   const uint16_t* k, const uint16_t* v, float* out, size_t out_stride, float* scratch,
                   int max_heads, LoadBlock load_block, Scores scores, ExpScores exp_scores,
                   AccumulateV accumulate_v) {
  AttendScratch st(scratch, rows, group, hd);
  std::fill(st.acc, st.acc + rows * group * hd, 0.0f);
  std::fill(st.m, st.m + rows * group, kNegInf);
  std::fill(st.l, st.l + rows * group, 0.0f);
  const int max_n_pos = first_n_pos + rows - 1;
  for (int j0 = 0; j0 < max_n_pos; j0 += kBlock) {
    load_block(k, v, j0, std::min(kBlock, max_n_pos - j0), hd, st);
    for (int r = 0; r < rows; ++r) {
      const int n_pos = first_n_pos + r;
      if (j0 >= n_pos) continue;
      const int nb = std::min(kBlock, n_pos - j0);
      const float* q_row = q + r * q_stride;
      for (int h = 0; h < group;) {
        const int heads = std::min(max_heads, group - h);
        scores(q_row, h, heads, st);
        for (int i = 0; i < heads; ++i) {
          const int state = r * group + h + i;
          float* acc = st.acc + state * hd;
          softmax_block(st.s + i * kBlock, nb, st.m[state], st.l[state], exp_scores,
                        [&](float alpha) { accumulate_v(acc, alpha, st.s + i * kBlock, nb, st.vf, hd); });
        }
        h += heads;
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < group; ++h) {
      const int state = r * group + h;
      for (int d = 0; d < hd; ++d) out[r * out_stride + h * hd + d] = st.acc[state * hd + d] / st.l[state];
    }
}

[[maybe_unused]] void attend_scalar(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                                    const uint16_t* k, const uint16_t* v, float* out, size_t out_stride,
                                    float* scratch) {
  auto scores = [&](const float* q_row, int h, int, AttendScratch& st) {
    const float* qh = q_row + h * hd;
    for (int j = 0; j < kBlock; ++j) {
      float x = 0.0f;
      for (int d = 0; d < hd; ++d) x = std::fma(qh[d], st.kt[d * kBlock + j], x);
      st.s[j] = x;
    }
  };
  auto exp_scores = [](float* s, int nb, float m_new) {
    for (int j = 0; j < nb; ++j) s[j] = exp_canonical(s[j] - m_new);
  };
  auto accumulate_v = [](float* acc, float alpha, const float* p, int nb, const float* vf, int hd) {
    for (int d = 0; d < hd; ++d) {
      float x = acc[d] * alpha;
      for (int j = 0; j < nb; ++j) x = std::fma(p[j], vf[j * hd + d], x);
      acc[d] = x;
    }
  };
  attend_blocks(q, q_stride, rows, first_n_pos, group, hd, k, v, out, out_stride, scratch, 1, load_block_scalar,
                scores, exp_scores, accumulate_v);
}

[[maybe_unused]] void silu_mul_scalar(const float* g, const float* u, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = silu_mul(g[i], u[i]);
}

[[maybe_unused]] void rms_norm_scalar(const float* x, const float* w, int n, float eps, float* out) {
  const float inverse = rms_inverse(dot_canonical(x, x, n), n, eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * inverse * w[i];
}

[[maybe_unused]] void quantize_row_scalar(const float* x, int k, int8_t* q, float* d, float* s, int32_t* sum) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = max_canonical(amax, std::fabs(xb[j]));
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
// ---- AVX2 (and AVX-512 VNNI for the integer dot) -------------------------------------------

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

inline __m256i broadcast4(const int8_t* p) {  // 4 activation bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// One block's weights of the 8 columns: chunk j holds elements 4j..4j+3 of every column.
template <WeightType T>
struct BlockChunks {
  __m256i w[8];
  explicit BlockChunks(const uint8_t* blk) {
    if constexpr (T == WeightType::Q4_1) {
      const __m256i mask = _mm256_set1_epi8(0x0F);
      for (int i = 0; i < 4; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * i));
        w[i] = _mm256_and_si256(raw, mask);
        w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
#ifdef CPU_ISA_AVX512
        w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128 as u8
#endif
      }
    }
  }

  // The 8 columns' exact integer sums against one activation block.
  __m256i isums(const int8_t* aq, int32_t asum) const {
#ifdef CPU_ISA_AVX512
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
      even = _mm256_dpbusd_epi32(even, w[j], broadcast4(aq + 4 * j));
      odd = _mm256_dpbusd_epi32(odd, w[j + 1], broadcast4(aq + 4 * j + 4));
    }
    __m256i sum = _mm256_add_epi32(even, odd);
    if constexpr (T == WeightType::Q8_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(asum * 128));
    return sum;
#else
    (void)asum;
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (T == WeightType::Q4_1) {
      // Nibbles x int8: a pair is at most 2 * 15 * 127, eight pairs fit int16 without saturating.
      __m256i p = _mm256_maddubs_epi16(w[0], broadcast4(aq));
      for (int j = 1; j < 8; ++j) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], broadcast4(aq + 4 * j)));
      return _mm256_madd_epi16(p, ones);
    } else {
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i x = broadcast4(aq + 4 * j);
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(x, w[j]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
      }
      return sum;
    }
#endif
  }
};

// Rows [m0, m0 + R) against one column group: a block's weights are unpacked once and applied
// to all R rows (weight-stationary); each (row, column) is the canonical fma chain.
template <WeightType T, int R>
void group_rows(const uint8_t* group, int nb, const QuantRows& a, int m0, float* out, size_t ldo) {
  constexpr size_t gbb = group_block_bytes(T);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * gbb;
    const BlockChunks<T> w(blk);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (T == WeightType::Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    for (int r = 0; r < R; ++r) {
      const size_t row = static_cast<size_t>(m0 + r), at = row * nb + b;
      const __m256 isum = _mm256_cvtepi32_ps(w.isums(a.q + row * a.k + b * kBlock, a.sum[at]));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a.d[at])), isum, acc[r]);
      if constexpr (T == WeightType::Q4_1) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + static_cast<size_t>(m0 + r) * ldo, acc[r]);
}

template <WeightType T>
void matmul_typed(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
  constexpr int kRows = 4;
  const int nb = w.k / kBlock;
  const size_t group_bytes = static_cast<size_t>(nb) * group_block_bytes(T);
  for (int g = g0; g < g1; ++g) {
    const uint8_t* group = w.data + g * group_bytes;
    float* o = out + g * kGroupCols;
    int m = 0;
    for (; m + kRows <= rows; m += kRows) group_rows<T, kRows>(group, nb, a, m, o, ldo);
    switch (rows - m) {
      case 3: group_rows<T, 3>(group, nb, a, m, o, ldo); break;
      case 2: group_rows<T, 2>(group, nb, a, m, o, ldo); break;
      case 1: group_rows<T, 1>(group, nb, a, m, o, ldo); break;
      default: break;
    }
  }
}

void matmul_simd(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
  if (w.type == WeightType::Q4_1) {
    matmul_typed<WeightType::Q4_1>(w, a, rows, g0, g1, out, ldo);
  } else {
    matmul_typed<WeightType::Q8_0>(w, a, rows, g0, g1, out, ldo);
  }
}

void attend_simd(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd, const uint16_t* k,
                 const uint16_t* v, float* out, size_t out_stride, float* scratch) {
  // Scores of 32 positions for two heads at once: 8 independent fma chains over hd, one lane
  // per position, so each score is exactly the scalar chain.
  auto scores = [&](const float* q_row, int h, int heads, AttendScratch& st) {
    const float* q0 = q_row + h * hd;
    const float* q1 = heads == 2 ? q0 + hd : q0;
    __m256 a0[4], a1[4];
    for (int i = 0; i < 4; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int d = 0; d < hd; ++d) {
      const __m256 b0 = _mm256_set1_ps(q0[d]), b1 = _mm256_set1_ps(q1[d]);
      const float* kd = st.kt + d * kBlock;
      for (int i = 0; i < 4; ++i) {
        const __m256 kv = _mm256_loadu_ps(kd + 8 * i);
        a0[i] = _mm256_fmadd_ps(b0, kv, a0[i]);
        a1[i] = _mm256_fmadd_ps(b1, kv, a1[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(st.s + 8 * i, a0[i]);
      _mm256_storeu_ps(st.s + kBlock + 8 * i, a1[i]);
    }
  };
  auto exp_scores = [](float* s, int nb, float m_new) {
    int j = 0;
    for (; j + kLanes <= nb; j += kLanes)
      _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m_new))));
    for (; j < nb; ++j) s[j] = exp_canonical(s[j] - m_new);
  };
  // 64 dims at a time held in registers over the block's positions (elementwise in d, so the
  // same chain per element as the scalar loop).
  auto accumulate_v = [](float* acc, float alpha, const float* p, int nb, const float* vf, int hd) {
    constexpr int kVecs = 8;
    const __m256 alpha8 = _mm256_set1_ps(alpha);
    for (int d0 = 0; d0 < hd; d0 += kVecs * kLanes) {
      const int vecs = std::min(kVecs, (hd - d0) / kLanes);
      __m256 x[kVecs];
      for (int i = 0; i < vecs; ++i) x[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + kLanes * i), alpha8);
      for (int j = 0; j < nb; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float* vj = vf + j * hd + d0;
        for (int i = 0; i < vecs; ++i) x[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + kLanes * i), x[i]);
      }
      for (int i = 0; i < vecs; ++i) _mm256_storeu_ps(acc + d0 + kLanes * i, x[i]);
    }
  };
  auto load_block = [](const uint16_t* k, const uint16_t* v, int j0, int nb, int hd, AttendScratch& st) {
    const uint16_t* kb = k + static_cast<size_t>(j0) * hd;
    for (int i = 0; i < kBlock * hd; i += kLanes) _mm256_storeu_ps(st.kt + i, load_half8(kb + i));
    clear_unwritten(nb, hd, st);
    const uint16_t* vb = v + static_cast<size_t>(j0) * hd;
    for (int i = 0; i < nb * hd; i += kLanes) _mm256_storeu_ps(st.vf + i, load_half8(vb + i));
  };
  attend_blocks(q, q_stride, rows, first_n_pos, group, hd, k, v, out, out_stride, scratch, 2, load_block, scores,
                exp_scores, accumulate_v);
}

inline float hsum8(__m256 v) {  // numerics.hpp's hsum8 fold
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

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
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + kLanes * i);
      amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], abs_mask));  // max is exact in any order
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
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
extern const Kernels kernels{ISA_NAME, matmul_simd, attend_simd, silu_mul_simd, rms_norm_simd, quantize_row_simd};
#else
extern const Kernels kernels{ISA_NAME,      matmul_scalar,  attend_scalar,
                             silu_mul_scalar, rms_norm_scalar, quantize_row_scalar};
#endif

}  // namespace ISA_NS
}  // namespace cpu
