// Attention of one instruction set (isa.hpp): a chunk of a KV head's fp16 cache against a
// tile of rows, online softmax over blocks of 32 positions in order.
#include <algorithm>
#include <limits>

#include "isa.hpp"

namespace cpu {
namespace ISA_NS {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

#ifdef CPU_SIMD
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
  // H broadcasts, then one V vector at a time: 3 x 4 accumulators and their operands are
  // AVX2's 16 registers (with all 4 V vectors live, one accumulator spilled and the chain
  // through memory took twice as long).
  for (int j = 0; j < nb; ++j) {
    __m256 pj[H];
    for (int h = 0; h < H; ++h) pj[h] = _mm256_set1_ps(p[h * kBlock + j]);
    for (int i = 0; i < NV; ++i) {
      const __m256 vj = load_half8(v + j * hd + d0 + kLanes * i);
      for (int h = 0; h < H; ++h) x[h][i] = _mm256_fmadd_ps(pj[h], vj, x[h][i]);
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
    for (int i = 0; i < 4; ++i) {
      __m256 x = _mm256_loadu_ps(s + kLanes * i);
      if (nb < kBlock) x = _mm256_blendv_ps(neg_inf, x, valid_lanes(i, nb));  // only a last block
      m = _mm256_max_ps(m, x);
    }
    return hmax8(m);
  };
  auto exp_sum = [](float* s, int nb, float m_new) {
    const __m256 m8 = _mm256_set1_ps(m_new);
    __m256 p[4];
    for (int i = 0; i < 4; ++i) {
      p[i] = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + kLanes * i), m8));
      if (nb < kBlock) p[i] = _mm256_and_ps(p[i], valid_lanes(i, nb));
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
#endif  // CPU_SIMD

}  // namespace

void attend_chunk(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd, const uint16_t* k,
                  const uint16_t* v, int chunk, float* states, float* scratch) {
#ifdef CPU_SIMD
  attend_chunk_simd(q, q_stride, rows, first_n_pos, group, hd, k, v, chunk, states, scratch);
#else
  attend_chunk_scalar(q, q_stride, rows, first_n_pos, group, hd, k, v, chunk, states, scratch);
#endif
}

}  // namespace ISA_NS
}  // namespace cpu
