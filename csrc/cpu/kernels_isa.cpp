// The hot kernels, compiled once per instruction set (CMake sets CPU_ISA_SCALAR, _AVX2 or
// _AVX512 and the matching -m flags). The SIMD code computes the canonical arithmetic of
// numerics.hpp and no other: exact integer block sums, then per (row, column) one fma chain
// over the blocks in order; reductions over 8 lanes folded as hsum8.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

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
  for (int g = g0; g < g1; ++g) {
    const uint8_t* group = group_start(w, g);
    const size_t stride = group_stride(w, g);
    for (int m = 0; m < rows; ++m) {
      float acc[kGroupCols] = {};
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = group + b * stride;
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

// The chunk loop shared by every path. Per block and row: `scores(q_row, group, hd, kt, s)`
// fills s [group][32] from the block's K^T (fp16, straight from the cache); per head,
// `block_max` is the largest of the block's nb scores and `exp_sum` turns s into
// p = exp(s - m_new) (zero past nb) and returns block_sum_canonical(p); then
// `accumulate_v(states, alpha, s, nb, v, group, hd)` rescales each head's acc by its alpha
// and adds p's weighted V rows in order. A last block's K lanes past nb were never written
// (the cache is not initialised): their scores are computed and then never used.
template <typename Scores, typename BlockMax, typename ExpSum, typename AccumulateV>
void attend_chunk_blocks(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                         const uint16_t* k, const uint16_t* v, int chunk, float* states, float* scratch,
                         Scores scores, BlockMax block_max, ExpSum exp_sum, AccumulateV accumulate_v) {
  float* s = scratch;                   // [group][kBlock]: scores, then p
  float* alpha = s + group * kBlock;    // [group]: each head's rescale of its state by the block
  const int sf = state_floats(hd);
  for (int i = 0; i < rows * group; ++i) {
    float* state = states + i * sf;
    std::fill(state, state + hd, 0.0f);
    state[hd] = kNegInf;
    state[hd + 1] = 0.0f;
  }
  const int end = std::min((chunk + 1) * kChunk, first_n_pos + rows - 1);
  for (int j0 = chunk * kChunk; j0 < end; j0 += kBlock) {
    const uint16_t* kt = k + static_cast<size_t>(j0) * hd;
    const uint16_t* vb = v + static_cast<size_t>(j0) * hd;
    for (int r = 0; r < rows; ++r) {
      const int n_pos = first_n_pos + r;
      if (j0 >= n_pos) continue;
      const int nb = std::min(kBlock, n_pos - j0);
      float* row_states = states + r * group * sf;
      scores(q + r * q_stride, group, hd, kt, s);
      for (int h = 0; h < group; ++h) {
        float* state = row_states + h * sf;
        const float m = state[hd];
        const float m_new = max_canonical(m, block_max(s + h * kBlock, nb));
        alpha[h] = m == kNegInf ? 0.0f : exp_canonical(m - m_new);
        const float sum = exp_sum(s + h * kBlock, nb, m_new);
        state[hd + 1] = state[hd + 1] * alpha[h] + sum;
        state[hd] = m_new;
      }
      accumulate_v(row_states, alpha, s, nb, vb, group, hd);
    }
  }
}

[[maybe_unused]] void attend_chunk_scalar(const float* q, size_t q_stride, int rows, int first_n_pos, int group,
                                          int hd, const uint16_t* k, const uint16_t* v, int chunk, float* states,
                                          float* scratch) {
  auto scores = [](const float* q_row, int group, int hd, const uint16_t* kt, float* s) {
    std::fill(s, s + group * kBlock, 0.0f);
    for (int d = 0; d < hd; ++d) {
      float kd[kBlock];
      for (int j = 0; j < kBlock; ++j) kd[j] = half_to_float(kt[d * kBlock + j]);
      for (int h = 0; h < group; ++h)
        for (int j = 0; j < kBlock; ++j) s[h * kBlock + j] = std::fma(q_row[h * hd + d], kd[j], s[h * kBlock + j]);
    }
  };
  auto block_max = [](const float* s, int nb) {
    float m = kNegInf;
    for (int j = 0; j < nb; ++j) m = max_canonical(m, s[j]);
    return m;
  };
  auto exp_sum = [](float* s, int nb, float m_new) {
    for (int j = 0; j < kBlock; ++j) s[j] = j < nb ? exp_canonical(s[j] - m_new) : 0.0f;
    return block_sum_canonical(s);
  };
  auto accumulate_v = [](float* states, const float* alpha, const float* p, int nb, const uint16_t* v, int group,
                         int hd) {
    for (int h = 0; h < group; ++h) {
      float* acc = states + h * state_floats(hd);
      for (int d = 0; d < hd; ++d) acc[d] = acc[d] * alpha[h];
    }
    for (int j = 0; j < nb; ++j)
      for (int d = 0; d < hd; ++d) {
        const float vd = half_to_float(v[j * hd + d]);
        for (int h = 0; h < group; ++h) {
          float* acc = states + h * state_floats(hd);
          acc[d] = std::fma(p[h * kBlock + j], vd, acc[d]);
        }
      }
  };
  attend_chunk_blocks(q, q_stride, rows, first_n_pos, group, hd, k, v, chunk, states, scratch, scores, block_max,
                      exp_sum, accumulate_v);
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
void group_rows(const uint8_t* group, size_t stride, int nb, const QuantRows& a, int m0, float* out, size_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
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

#ifdef CPU_ISA_AVX512
// GCC 12's AVX-512 intrinsics fill an unused operand with _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized then reports at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Two adjacent column groups at once, 16 columns per zmm: columns 0-7 from group g, 8-15 from
// g + 1. Each broadcast 4-byte run of activations then feeds 16 columns: on Zen 4 a dpbusd with
// a broadcast operand takes about as long for a zmm as for a ymm (measured 7.9 vs 6.2 cycles
// for 8), and a row's matmul about 1.3x less. Per column, the same arithmetic as group_rows.
inline __m512i load_pair(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

inline __m512 load_pair_halves(const uint8_t* lo, const uint8_t* hi) {  // 8 fp16 from each
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))));
}

template <WeightType T>
struct PairChunks {
  __m512i w[8];
  PairChunks(const uint8_t* lo, const uint8_t* hi) {
    if constexpr (T == WeightType::Q4_1) {
      const __m512i mask = _mm512_set1_epi8(0x0F);
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = load_pair(lo + 32 + 32 * i, hi + 32 + 32 * i);
        w[i] = _mm512_and_si512(raw, mask);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      }
    } else {
      for (int j = 0; j < 8; ++j)
        w[j] = _mm512_xor_si512(load_pair(lo + 16 + 32 * j, hi + 16 + 32 * j), _mm512_set1_epi8(static_cast<char>(0x80)));
    }
  }

  __m512i isums(const int8_t* aq, int32_t asum) const {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      int32_t x0, x1;
      std::memcpy(&x0, aq + 4 * j, sizeof x0);
      std::memcpy(&x1, aq + 4 * j + 4, sizeof x1);
      even = _mm512_dpbusd_epi32(even, w[j], _mm512_set1_epi32(x0));
      odd = _mm512_dpbusd_epi32(odd, w[j + 1], _mm512_set1_epi32(x1));
    }
    __m512i sum = _mm512_add_epi32(even, odd);
    if constexpr (T == WeightType::Q8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(asum * 128));
    return sum;
  }
};

template <WeightType T, int R>
void pair_rows(const uint8_t* pair, int nb, const QuantRows& a, int m0, float* out, size_t ldo) {
  constexpr size_t gbb = group_block_bytes(T);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* lo = pair + 2 * b * gbb;
    const uint8_t* hi = lo + gbb;
    const PairChunks<T> w(lo, hi);
    const __m512 dw = load_pair_halves(lo, hi);
    __m512 mw = _mm512_setzero_ps();
    if constexpr (T == WeightType::Q4_1) mw = load_pair_halves(lo + 16, hi + 16);
    for (int r = 0; r < R; ++r) {
      const size_t row = static_cast<size_t>(m0 + r), at = row * nb + b;
      const __m512 isum = _mm512_cvtepi32_ps(w.isums(a.q + row * a.k + b * kBlock, a.sum[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[at])), isum, acc[r]);
      if constexpr (T == WeightType::Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + static_cast<size_t>(m0 + r) * ldo, acc[r]);
}
#pragma GCC diagnostic pop
#endif

// f(std::integral_constant<int, R>{}, m0) over rows in tiles of R = 4, then the 3, 2 or 1 left.
template <typename F>
void row_tiles(int rows, F f) {
  int m = 0;
  for (; m + 4 <= rows; m += 4) f(std::integral_constant<int, 4>{}, m);
  switch (rows - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

template <WeightType T>
void matmul_typed(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
  const int nb = w.k / kBlock;
  for (int g = g0; g < g1;) {
    const uint8_t* group = group_start(w, g);
    float* o = out + g * kGroupCols;
#ifdef CPU_ISA_AVX512
    if (g % 2 == 0 && g + 1 < g1) {  // a whole pair (the last group may stand alone)
      row_tiles(rows, [&](auto tile, int m) { pair_rows<T, decltype(tile)::value>(group, nb, a, m, o, ldo); });
      g += 2;
      continue;
    }
#endif
    const size_t stride = group_stride(w, g);
    row_tiles(rows, [&](auto tile, int m) { group_rows<T, decltype(tile)::value>(group, stride, nb, a, m, o, ldo); });
    ++g;
  }
}

void matmul_simd(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
  if (w.type == WeightType::Q4_1) {
    matmul_typed<WeightType::Q4_1>(w, a, rows, g0, g1, out, ldo);
  } else {
    matmul_typed<WeightType::Q8_0>(w, a, rows, g0, g1, out, ldo);
  }
}

inline float hsum8(__m256 v) {  // numerics.hpp's hsum8 fold
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Scores of 32 positions for H heads at once: 4H independent fma chains over hd, one lane per
// position, so each score is exactly the scalar chain (fp16 -> fp32 is exact).
template <int H>
void scores_simd(const float* qh, int hd, const uint16_t* kt, float* s) {
  __m256 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    __m256 b[H];
    for (int h = 0; h < H; ++h) b[h] = _mm256_set1_ps(qh[h * hd + d]);
    const uint16_t* kd = kt + d * kBlock;
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = load_half8(kd + kLanes * i);
      for (int h = 0; h < H; ++h) acc[h][i] = _mm256_fmadd_ps(b[h], kv, acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(s + h * kBlock + kLanes * i, acc[h][i]);
}

// acc of H heads, dims [d0, d0 + 8 NV): rescaled by alpha, then p's weighted V rows added in
// order (elementwise in d, so the same chain per element as the scalar loop).
template <int H, int NV>
void accumulate_v_simd(float* states, const float* alpha, const float* p, int nb, const uint16_t* v, int hd,
                       int d0) {
  const int sf = state_floats(hd);
  __m256 x[H][NV];
  for (int h = 0; h < H; ++h) {
    const __m256 a = _mm256_set1_ps(alpha[h]);
    for (int i = 0; i < NV; ++i) x[h][i] = _mm256_mul_ps(_mm256_loadu_ps(states + h * sf + d0 + kLanes * i), a);
  }
  for (int j = 0; j < nb; ++j) {
    __m256 vj[NV];
    for (int i = 0; i < NV; ++i) vj[i] = load_half8(v + j * hd + d0 + kLanes * i);
    for (int h = 0; h < H; ++h) {
      const __m256 pj = _mm256_set1_ps(p[h * kBlock + j]);
      for (int i = 0; i < NV; ++i) x[h][i] = _mm256_fmadd_ps(pj, vj[i], x[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(states + h * sf + d0 + kLanes * i, x[h][i]);
}

// accumulate_v_simd for `heads` (1 to 3) heads.
template <int NV>
void accumulate_v_heads(int heads, float* states, const float* alpha, const float* p, int nb, const uint16_t* v,
                        int hd, int d0) {
  switch (heads) {
    case 3: return accumulate_v_simd<3, NV>(states, alpha, p, nb, v, hd, d0);
    case 2: return accumulate_v_simd<2, NV>(states, alpha, p, nb, v, hd, d0);
    default: return accumulate_v_simd<1, NV>(states, alpha, p, nb, v, hd, d0);
  }
}

// Lanes of position j0 + 8i + l that lie below nb, as an all-ones mask.
inline __m256 valid_lanes(int i, int nb) {
  const __m256i index = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kLanes * i));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb), index));
}

void attend_chunk_simd(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                       const uint16_t* k, const uint16_t* v, int chunk, float* states, float* scratch) {
  // Heads go 3 at a time: 12 accumulators, which with their operands fit AVX2's 16 registers.
  auto scores = [](const float* q_row, int group, int hd, const uint16_t* kt, float* s) {
    for (int h = 0; h < group; h += 3) {
      const float* qh = q_row + h * hd;
      switch (std::min(3, group - h)) {
        case 3: scores_simd<3>(qh, hd, kt, s + h * kBlock); break;
        case 2: scores_simd<2>(qh, hd, kt, s + h * kBlock); break;
        default: scores_simd<1>(qh, hd, kt, s + h * kBlock); break;
      }
    }
  };
  auto block_max = [](const float* s, int nb) {  // max is exact in any order
    const __m256 neg_inf = _mm256_set1_ps(kNegInf);
    __m256 m = neg_inf;
    for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + kLanes * i), valid_lanes(i, nb)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  };
  auto exp_sum = [](float* s, int nb, float m_new) {
    const __m256 m8 = _mm256_set1_ps(m_new);
    __m256 p[4];
    for (int i = 0; i < 4; ++i) {
      p[i] = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + kLanes * i), m8)), valid_lanes(i, nb));
      _mm256_storeu_ps(s + kLanes * i, p[i]);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), p[2]), p[3]));
  };
  // 32 dims of 3 heads at a time (12 accumulators); 8 at a time for a head_dim's tail.
  auto accumulate_v = [](float* states, const float* alpha, const float* p, int nb, const uint16_t* v, int group,
                         int hd) {
    for (int h = 0; h < group; h += 3) {
      float* sh = states + h * state_floats(hd);
      const float* ah = alpha + h;
      const float* ph = p + h * kBlock;
      const int heads = std::min(3, group - h);
      int d0 = 0;
      for (; d0 + 4 * kLanes <= hd; d0 += 4 * kLanes) accumulate_v_heads<4>(heads, sh, ah, ph, nb, v, hd, d0);
      for (; d0 < hd; d0 += kLanes) accumulate_v_heads<1>(heads, sh, ah, ph, nb, v, hd, d0);
    }
  };
  attend_chunk_blocks(q, q_stride, rows, first_n_pos, group, hd, k, v, chunk, states, scratch, scores, block_max,
                      exp_sum, accumulate_v);
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
extern const Kernels kernels{ISA_NAME, matmul_simd, attend_chunk_simd, silu_mul_simd, rms_norm_simd, quantize_row_simd};
#else
extern const Kernels kernels{ISA_NAME,      matmul_scalar,  attend_chunk_scalar,
                             silu_mul_scalar, rms_norm_scalar, quantize_row_scalar};
#endif

}  // namespace ISA_NS
}  // namespace cpu
