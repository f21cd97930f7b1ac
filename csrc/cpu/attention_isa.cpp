// Attention of one instruction set (isa.hpp): a chunk of a KV head's fp16 cache against a
// tile of rows, online softmax over blocks of 32 positions in order.
#include <algorithm>
#include <limits>

#include "isa.hpp"

namespace cpu {
namespace ISA_NS {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A block's K^T and V to fetch (null: none). K^T's line d is dim d's 32 positions, V's is
// position d's dims: hd lines each.
struct NextBlock {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;

  void fetch_line(int d) const {
    if (k == nullptr) return;
    __builtin_prefetch(k + d * kBlock);
    __builtin_prefetch(v + d * kBlock);
  }
};

// The chunk loop shared by every path. Per block, rows go RowsAtOnce at a time (those of them
// that reach the block): `scores(q_row, q_stride, nr, group, hd, kt, s, next)` fills s
// [nr][group][32] from the block's K^T (fp16, straight from the cache) and, where `next` is not
// null (the first rows of a block, with a block after it), asks for the next block's K^T and V
// a line of each per dim, among its fmas; `softmax(states, sf_row, s, alpha, nbs,
// nr, group, hd)` updates each (row, head)'s state as softmax_each does and leaves p in s and
// its rescale in alpha; then `accumulate_v(states, sf_row, alpha, s, nbs, nr, v, group, hd)`
// rescales each (row, head)'s acc by its alpha and adds p's weighted V rows in order, each row
// its own nb of them. A row's arithmetic is the same whichever rows share its call. A last
// block's K lanes past nb were never written (the cache is not initialised): their scores are
// computed and then never used.
template <int RowsAtOnce, typename Scores, typename Softmax, typename AccumulateV>
void attend_chunk_blocks(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                         const KvPages& kv, int chunk, float* states, float* scratch, Scores scores, Softmax softmax,
                         AccumulateV accumulate_v) {
  float* s = scratch;                                 // [RowsAtOnce][group][kBlock]: scores, then p
  float* alpha = s + RowsAtOnce * group * kBlock;     // [RowsAtOnce][group]: each state's rescale
  const int sf = state_floats(hd), sf_row = group * sf;
  for (int i = 0; i < rows * group; ++i) {
    float* state = states + i * sf;
    std::fill(state, state + hd, 0.0f);
    state[hd] = kNegInf;
    state[hd + 1] = 0.0f;
  }
  const int end = std::min((chunk + 1) * kChunk, first_n_pos + rows - 1);
  for (int j0 = chunk * kChunk; j0 < end; j0 += kBlock) {
    const uint16_t* kt = kv.k_block(j0 / kBlock);
    const uint16_t* vb = kv.v_block(j0 / kBlock);
    // The next block's K^T and V, fetched while this one is computed: spread over the scores'
    // dims, where asking for all 128 lines at once left them late (8 KB in one burst; measured
    // on a Xeon, 2 threads, 1,024 positions: attention 1.32 -> 1.08 ms a step for 1 row, 4.10
    // -> 3.59 ms for 8).
    const NextBlock next = j0 + kBlock < end ? NextBlock{kv.k_block(j0 / kBlock + 1), kv.v_block(j0 / kBlock + 1)}
                                             : NextBlock{};
    for (int r0 = 0; r0 < rows; r0 += RowsAtOnce) {
      const int r_first = std::max(r0, j0 - first_n_pos + 1);  // row r reaches positions below first_n_pos + r
      const int nr = std::min(r0 + RowsAtOnce, rows) - r_first;
      if (nr <= 0) continue;
      int nbs[RowsAtOnce];
      scores(q + r_first * q_stride, q_stride, nr, group, hd, kt, s, r0 == 0 ? next : NextBlock{});
      for (int i = 0; i < nr; ++i) nbs[i] = std::min(kBlock, first_n_pos + r_first + i - j0);
      softmax(states + r_first * sf_row, sf_row, s, alpha, nbs, nr, group, hd);
      accumulate_v(states + r_first * sf_row, sf_row, alpha, s, nbs, nr, vb, group, hd);
    }
  }
}

// One block's online-softmax step for each (row, head) of a pass: with `block_max` the largest
// of the row's nb scores and `exp_sum` turning s into p = exp(s - m_new) (zero past nb) and
// returning block_sum_canonical(p), m_new = max(m, block max), alpha = exp(m - m_new) (0 for a
// fresh state), l = l * alpha + the block's sum, m = m_new.
template <typename BlockMax, typename ExpSum>
auto softmax_each(BlockMax block_max, ExpSum exp_sum) {
  return [=](float* states, int sf_row, float* s, float* alpha, const int* nbs, int nr, int group, int hd) {
    const int sf = state_floats(hd);
    for (int i = 0; i < nr; ++i)
      for (int h = 0; h < group; ++h) {
        float* state = states + i * sf_row + h * sf;
        float* sh = s + (i * group + h) * kBlock;
        const float m = state[hd];
        const float m_new = max_canonical(m, block_max(sh, nbs[i]));
        alpha[i * group + h] = m == kNegInf ? 0.0f : exp_canonical(m - m_new);
        const float sum = exp_sum(sh, nbs[i], m_new);
        state[hd + 1] = state[hd + 1] * alpha[i * group + h] + sum;
        state[hd] = m_new;
      }
  };
}

[[maybe_unused]] void attend_chunk_scalar(const float* q, size_t q_stride, int rows, int first_n_pos, int group,
                                          int hd, const KvPages& kv, int chunk, float* states, float* scratch) {
  auto scores = [](const float* q_row, size_t, int, int group, int hd, const uint16_t* kt, float* s, NextBlock) {
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
  auto accumulate_v = [](float* states, int, const float* alpha, const float* p, const int* nbs, int,
                         const uint16_t* v, int group, int hd) {
    for (int h = 0; h < group; ++h) {
      float* acc = states + h * state_floats(hd);
      for (int d = 0; d < hd; ++d) acc[d] = acc[d] * alpha[h];
    }
    for (int j = 0; j < nbs[0]; ++j)
      for (int d = 0; d < hd; ++d) {
        const float vd = half_to_float(v[j * hd + d]);
        for (int h = 0; h < group; ++h) {
          float* acc = states + h * state_floats(hd);
          acc[d] = std::fma(p[h * kBlock + j], vd, acc[d]);
        }
      }
  };
  attend_chunk_blocks<1>(q, q_stride, rows, first_n_pos, group, hd, kv, chunk, states, scratch, scores,
                         softmax_each(block_max, exp_sum), accumulate_v);
}

#ifdef CPU_SIMD
// Scores of 32 positions for H heads at once: 4H independent fma chains over hd, one lane per
// position, so each score is exactly the scalar chain (fp16 -> fp32 is exact).
template <int H>
void scores_simd(const float* qh, int hd, const uint16_t* kt, float* s, NextBlock next) {
  __m256 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    next.fetch_line(d);
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

#ifdef CPU_ISA_AVX512
#include "attention_avx512.hpp"
#endif  // CPU_ISA_AVX512

// The softmax steps every SIMD path shares.
[[maybe_unused]] float block_max_simd(const float* s, int nb) {  // max is exact in any order
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 m = neg_inf;
  for (int i = 0; i < 4; ++i) {
    __m256 x = _mm256_loadu_ps(s + kLanes * i);
    if (nb < kBlock) x = _mm256_blendv_ps(neg_inf, x, valid_lanes(i, nb));  // only a last block
    m = _mm256_max_ps(m, x);
  }
  return hmax8(m);
}

[[maybe_unused]] float exp_sum_simd(float* s, int nb, float m_new) {
  const __m256 m8 = _mm256_set1_ps(m_new);
  __m256 p[4];
  for (int i = 0; i < 4; ++i) {
    p[i] = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + kLanes * i), m8));
    if (nb < kBlock) p[i] = _mm256_and_ps(p[i], valid_lanes(i, nb));
    _mm256_storeu_ps(s + kLanes * i, p[i]);
  }
  return hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), p[2]), p[3]));
}

void attend_chunk_simd(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                       const KvPages& kv, int chunk, float* states, float* scratch) {
#ifdef CPU_ISA_AVX512
  auto scores = [](const float* q_row, size_t q_stride, int nr, int group, int hd, const uint16_t* kt, float* s,
                   NextBlock next) {
    for (int h0 = 0; h0 < group; h0 += kHeads)
      with_constant<kRowsPerKvPass>(nr, [&](auto r) {
        with_constant<kHeads>(std::min(kHeads, group - h0), [&](auto h) {
          scores_rows<decltype(r)::value, decltype(h)::value>(q_row, q_stride, group, hd, h0, kt, s,
                                                              h0 == 0 ? next : NextBlock{});
        });
      });
  };
  // 32 dims at a time, then 16; a head_dim's last 8 take the AVX2 kernel, row by row.
  auto accumulate_v = [](float* states, int sf_row, const float* alpha, const float* p, const int* nbs, int nr,
                         const uint16_t* v, int group, int hd) {
    for (int h0 = 0; h0 < group; h0 += kHeads) {
      int d0 = 0;
      with_constant<kRowsPerKvPass>(nr, [&](auto r) {
        with_constant<kHeads>(std::min(kHeads, group - h0), [&](auto h) {
          constexpr int NR = decltype(r)::value, H = decltype(h)::value;
          for (; d0 + 32 <= hd; d0 += 32) accumulate_v_rows<NR, H, 2>(states, sf_row, alpha, p, nbs, v, group, hd, h0, d0);
          for (; d0 + 16 <= hd; d0 += 16) accumulate_v_rows<NR, H, 1>(states, sf_row, alpha, p, nbs, v, group, hd, h0, d0);
        });
      });
      for (; d0 < hd; d0 += kLanes)
        for (int i = 0; i < nr; ++i)
          for (int h = h0; h < std::min(group, h0 + kHeads); ++h)
            accumulate_v_simd<1, 1>(states + i * sf_row + h * state_floats(hd), alpha + i * group + h,
                                    p + (i * group + h) * kBlock, nbs[i], v, hd, d0);
    }
  };
  attend_chunk_blocks<kRowsPerKvPass>(q, q_stride, rows, first_n_pos, group, hd, kv, chunk, states, scratch, scores,
                                      softmax_16, accumulate_v);
#else
  // Heads go 3 at a time: 12 accumulators, which with their operands fit AVX2's 16 registers.
  auto scores = [](const float* q_row, size_t, int, int group, int hd, const uint16_t* kt, float* s, NextBlock next) {
    for (int h = 0; h < group; h += 3) {
      const float* qh = q_row + h * hd;
      const NextBlock fetch = h == 0 ? next : NextBlock{};
      switch (std::min(3, group - h)) {
        case 3: scores_simd<3>(qh, hd, kt, s + h * kBlock, fetch); break;
        case 2: scores_simd<2>(qh, hd, kt, s + h * kBlock, fetch); break;
        default: scores_simd<1>(qh, hd, kt, s + h * kBlock, fetch); break;
      }
    }
  };
  // 32 dims of 3 heads at a time (12 accumulators); 8 at a time for a head_dim's tail.
  auto accumulate_v = [](float* states, int, const float* alpha, const float* p, const int* nbs, int,
                         const uint16_t* v, int group, int hd) {
    for (int h = 0; h < group; h += 3) {
      float* sh = states + h * state_floats(hd);
      const float* ah = alpha + h;
      const float* ph = p + h * kBlock;
      const int heads = std::min(3, group - h);
      int d0 = 0;
      for (; d0 + 4 * kLanes <= hd; d0 += 4 * kLanes) accumulate_v_heads<4>(heads, sh, ah, ph, nbs[0], v, hd, d0);
      for (; d0 < hd; d0 += kLanes) accumulate_v_heads<1>(heads, sh, ah, ph, nbs[0], v, hd, d0);
    }
  };
  attend_chunk_blocks<1>(q, q_stride, rows, first_n_pos, group, hd, kv, chunk, states, scratch, scores,
                         softmax_each(block_max_simd, exp_sum_simd), accumulate_v);
#endif
}
#endif  // CPU_SIMD

}  // namespace

void attend_chunk(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd, const KvPages& kv,
                  int chunk, float* states, float* scratch) {
#ifdef CPU_SIMD
  attend_chunk_simd(q, q_stride, rows, first_n_pos, group, hd, kv, chunk, states, scratch);
#else
  attend_chunk_scalar(q, q_stride, rows, first_n_pos, group, hd, kv, chunk, states, scratch);
#endif
}

}  // namespace ISA_NS
}  // namespace cpu
