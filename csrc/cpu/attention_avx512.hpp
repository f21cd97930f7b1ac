// The avx512 and amx paths' attention steps. Part of attention_isa.cpp: included there, inside
// its namespace, when CMake builds an AVX-512 set (CPU_ISA_AVX512), after NextBlock and
// softmax_each, which it reuses.
#pragma once

// GCC 12's AVX-512 intrinsics fill an unused operand with _mm512_undefined_*(), which its own
// -Wmaybe-uninitialized then reports at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// AVX-512: up to kRowsPerKvPass rows of a tile per block, 16 positions or dims per register. A
// block's K^T row and V row are converted from fp16 once for those rows and up to kHeads heads,
// and their chains run side by side; each score and each acc element is still its own fma
// chain, in the order the scalar path takes.
constexpr int kHeads = 3;  // 4 rows x 3 heads x 2 registers: 24 accumulators of 32

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// s [NR][group][32], heads [h0, h0 + H): one chain per (row, head, position) over hd.
template <int NR, int H>
void scores_rows(const float* q, size_t q_stride, int group, int hd, int h0, const uint16_t* kt, float* s,
                 NextBlock next) {
  __m512 acc[NR][H][2];
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < H; ++h) acc[r][h][0] = acc[r][h][1] = _mm512_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    next.fetch_line(d);
    const __m512 k0 = load_half16(kt + d * kBlock), k1 = load_half16(kt + d * kBlock + 16);
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < H; ++h) {
        const __m512 b = _mm512_set1_ps(q[r * q_stride + (h0 + h) * hd + d]);
        acc[r][h][0] = _mm512_fmadd_ps(b, k0, acc[r][h][0]);
        acc[r][h][1] = _mm512_fmadd_ps(b, k1, acc[r][h][1]);
      }
  }
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < H; ++h) {
      float* out = s + (r * group + h0 + h) * kBlock;
      _mm512_storeu_ps(out, acc[r][h][0]);
      _mm512_storeu_ps(out + 16, acc[r][h][1]);
    }
}

// acc of NR rows x heads [h0, h0 + H), dims [d0, d0 + 16 NV): rescaled by alpha, then the
// weighted V rows added in order, row i taking nbs[i] of them (a row never adds a V row past
// its own positions: those may be unwritten memory).
template <int NR, int H, int NV>
void accumulate_v_rows(float* states, int sf_row, const float* alpha, const float* p, const int* nbs,
                       const uint16_t* v, int group, int hd, int h0, int d0) {
  const int sf = state_floats(hd);
  __m512 x[NR][H][NV];
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < H; ++h) {
      const __m512 a = _mm512_set1_ps(alpha[r * group + h0 + h]);
      const float* acc = states + r * sf_row + (h0 + h) * sf + d0;
      for (int i = 0; i < NV; ++i) x[r][h][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), a);
    }
  auto add = [&](int j, auto r_begin) {  // position j for rows [r_begin, NR)
    __m512 vj[NV];
    for (int i = 0; i < NV; ++i) vj[i] = load_half16(v + j * hd + d0 + 16 * i);
    for (int r = decltype(r_begin)::value; r < NR; ++r)
      for (int h = 0; h < H; ++h) {
        const __m512 pj = _mm512_set1_ps(p[(r * group + h0 + h) * kBlock + j]);
        for (int i = 0; i < NV; ++i) x[r][h][i] = _mm512_fmadd_ps(pj, vj[i], x[r][h][i]);
      }
  };
  int j = 0;
  static_for<NR>([&](auto r) {  // each later row reaches one position further
    for (; j < nbs[decltype(r)::value]; ++j) add(j, r);
  });
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < H; ++h) {
      float* acc = states + r * sf_row + (h0 + h) * sf + d0;
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, x[r][h][i]);
    }
}

// The softmax steps in 16 lanes: exp16 is exp8 lane for lane (the same operations in the same
// order), and a block's sum adds its four 8-position quarters as exp_sum_simd does.
inline __m512 exp16(__m512 x) {
  using namespace expc;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kMin)), _mm512_set1_ps(kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

inline __m256 high_half(__m512 v) {  // AVX-512F alone (extractf32x8 is AVX-512DQ)
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// Positions [16 i, 16 i + 16) of a block that lie below nb.
inline __mmask16 valid_mask(int i, int nb) {
  const int valid = std::clamp(nb - 16 * i, 0, 16);
  return static_cast<__mmask16>((1u << valid) - 1u);
}

float block_max_16(const float* s, int nb) {  // max is exact in any order
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512 m = _mm512_max_ps(_mm512_mask_loadu_ps(neg_inf, valid_mask(0, nb), s),
                                 _mm512_mask_loadu_ps(neg_inf, valid_mask(1, nb), s + 16));
  return hmax8(_mm256_max_ps(_mm512_castps512_ps256(m), high_half(m)));
}

float exp_sum_16(float* s, int nb, float m_new) {
  const __m512 m16 = _mm512_set1_ps(m_new);
  __m512 p[2];
  for (int i = 0; i < 2; ++i) {
    p[i] = _mm512_maskz_mov_ps(valid_mask(i, nb), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * i), m16)));
    _mm512_storeu_ps(s + 16 * i, p[i]);
  }
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(p[0]), high_half(p[0])),
                                                 _mm512_castps512_ps256(p[1])),
                                   high_half(p[1]));
  return hsum8(sum);
}

// softmax_each 16 (row, head) states at a time: their block maxima first, then their alphas in
// one exp16 (exp_canonical lane for lane), then the sums.
void softmax_16(float* states, int sf_row, float* s, float* alpha, const int* nbs, int nr, int group, int hd) {
  const int sf = state_floats(hd), count = nr * group;
  auto state = [&](int k) { return states + (k / group) * sf_row + (k % group) * sf; };
  for (int k0 = 0; k0 < count; k0 += 16) {
    const int n = std::min(16, count - k0);
    alignas(64) float m_old[16], m_new[16];
    for (int j = 0; j < n; ++j) {
      m_old[j] = state(k0 + j)[hd];
      m_new[j] = max_canonical(m_old[j], block_max_16(s + (k0 + j) * kBlock, nbs[(k0 + j) / group]));
    }
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 old = _mm512_maskz_loadu_ps(lanes, m_old);
    const __mmask16 seen = _mm512_mask_cmp_ps_mask(lanes, old, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m512 a = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(old, _mm512_maskz_loadu_ps(lanes, m_new))));
    _mm512_mask_storeu_ps(alpha + k0, lanes, a);
    for (int j = 0; j < n; ++j) {
      float* st = state(k0 + j);
      st[hd + 1] = st[hd + 1] * alpha[k0 + j] + exp_sum_16(s + (k0 + j) * kBlock, nbs[(k0 + j) / group], m_new[j]);
      st[hd] = m_new[j];
    }
  }
}

#pragma GCC diagnostic pop
