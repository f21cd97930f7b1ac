// The quantized matmul of one instruction set (isa.hpp): weight-stationary over the step's
// rows, threads splitting column groups (the caller's g0, g1).
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>  // matmul_amx.hpp keeps its scratch in one

#include "isa.hpp"

namespace cpu {
namespace ISA_NS {
namespace {

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

#ifdef CPU_SIMD
// Weights stream from memory once per step, each thread through its own columns. Asking for the
// bytes kPrefetchBytes ahead of the block in hand keeps them coming: measured on a Xeon with
// AVX-512 and AMX, a 1-row step at a 1,024-token context 7.4 -> 6.3 ms with the weights in
// cache, 11.5 -> 10.5 ms with every cache flushed, 8 rows 16.3 -> 14.3 ms (1 KB to 8 KB ahead
// all gain; none changes a bit). Into L2 (T1), 8 KB ahead, rather than into L1 4 KB ahead: a
// further 3-5% on flushed 1-row steps (amx and avx2 paths, A/B in alternating processes), as a
// prefetch into L1 holds one of the core's few fill buffers until its line arrives.
constexpr size_t kPrefetchBytes = 8192;

inline void prefetch_ahead(const uint8_t* block, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + at), _MM_HINT_T1);
}

inline __m256i broadcast4(const int8_t* p) {  // 4 activation bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// The exact integer sums of rows [m0, m0 + R) against block b of one column group (lane c:
// column c). Chunk j of the block holds elements 4j..4j+3 of every column; each chunk is
// unpacked once for all R rows (weight-stationary). Integer sums are exact in any order.
template <WeightType T, int R>
void block_isums(const uint8_t* blk, const QuantRows& a, int m0, int b, __m256i isum[R]) {
  const int8_t* aq[R];
  for (int r = 0; r < R; ++r) aq[r] = a.q + static_cast<size_t>(m0 + r) * a.k + b * kBlock;
  auto load = [blk](size_t offset) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + offset)); };
#ifdef CPU_ISA_AVX512
  // VNNI: u8 weights x s8 activations straight into int32 lanes, two chunks per step: Q4_1's
  // nibbles of byte run i (elements 4i.. and 16 + 4i..), or Q8_0's chunks 2i and 2i + 1.
  __m256i even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    __m256i w0, w1;
    int e0, e1;
    if constexpr (T == WeightType::Q4_1) {
      const __m256i raw = load(32 + 32 * i), mask = _mm256_set1_epi8(0x0F);
      w0 = _mm256_and_si256(raw, mask);
      w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      e0 = 4 * i, e1 = 16 + 4 * i;
    } else {  // w + 128 as u8; the 128 * sum(a) that adds is taken off below
      const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
      w0 = _mm256_xor_si256(load(16 + 64 * i), bias);
      w1 = _mm256_xor_si256(load(48 + 64 * i), bias);
      e0 = 8 * i, e1 = 8 * i + 4;
    }
    for (int r = 0; r < R; ++r) {
      even[r] = _mm256_dpbusd_epi32(even[r], w0, broadcast4(aq[r] + e0));
      odd[r] = _mm256_dpbusd_epi32(odd[r], w1, broadcast4(aq[r] + e1));
    }
  }
  for (int r = 0; r < R; ++r) {
    isum[r] = _mm256_add_epi32(even[r], odd[r]);
    if constexpr (T == WeightType::Q8_0)
      isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(a.sum[static_cast<size_t>(m0 + r) * (a.k / kBlock) + b] * 128));
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (T == WeightType::Q4_1) {
    // Nibbles x int8: a pair is at most 2 * 15 * 127, eight pairs fit int16 without saturating.
    // All 8 chunks unpacked first, then each row's 8 maddubs: measured faster than chunk by
    // chunk (as Q8_0 goes below), though a row accumulator spills.
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i w[8];
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = load(32 + 32 * i);
      w[i] = _mm256_and_si256(raw, mask);
      w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    }
    for (int r = 0; r < R; ++r) {
      __m256i p = _mm256_maddubs_epi16(w[0], broadcast4(aq[r]));
      for (int j = 1; j < 8; ++j) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], broadcast4(aq[r] + 4 * j)));
      isum[r] = _mm256_madd_epi16(p, ones);
    }
  } else {
    // maddubs takes u8 x s8: |w| once per chunk, the weight's sign moved onto each activation.
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load(16 + 32 * j);
      const __m256i abs_w = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(broadcast4(aq[r] + 4 * j), w));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
      }
    }
  }
#endif
}

// Rows [m0, m0 + R) against one column group: each (row, column) is the canonical fma chain.
template <WeightType T, int R>
void group_rows(const uint8_t* group, size_t stride, int nb, const QuantRows& a, int m0, float* out, size_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
    __m256i isum[R];
    prefetch_ahead(blk, group_block_bytes(T));
    block_isums<T, R>(blk, a, m0, b, isum);
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk);  // d[8], then Q4_1's m[8]
    const __m256 dw = load_half8(scales);
    __m256 mw = _mm256_setzero_ps();
    if constexpr (T == WeightType::Q4_1) mw = load_half8(scales + kGroupCols);
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(m0 + r) * nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a.d[at])), _mm256_cvtepi32_ps(isum[r]), acc[r]);
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

// A pair's block as 8 chunks, chunk j = elements 4j..4j+3 of each of the 16 columns: Q4_1's
// nibbles (u8), Q8_0's int8 weights + 128 (u8, for dpbusd) or as they are.
template <WeightType T>
struct PairChunks {
  __m512i w[8];
  PairChunks(const uint8_t* lo, const uint8_t* hi, bool q8_as_u8 = true) {
    if constexpr (T == WeightType::Q4_1) {
      const __m512i mask = _mm512_set1_epi8(0x0F);
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = load_pair(lo + 32 + 32 * i, hi + 32 + 32 * i);
        w[i] = _mm512_and_si512(raw, mask);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      }
    } else {
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(q8_as_u8 ? 0x80 : 0));
      for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(load_pair(lo + 16 + 32 * j, hi + 16 + 32 * j), bias);
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

// Rows per pair_rows call, each call unpacking the pair's weights once. Past 8 rows its R
// accumulators and the 8 unpacked chunks no longer all fit the 32 zmm registers and some
// spill, but unpacking once for up to 16 rows pays more (a Xeon, 2 threads, 1,024 positions,
// whole steps, medians of 5 alternating runs: 9 rows 12.6 -> 11.6 ms, 13 rows 15.4 -> 14.9,
// 17 rows 19.7 -> 18.6; 1 and 8 rows within the noise).
constexpr int kPairTileRows = 16;

template <WeightType T, int R>
void pair_rows(const uint8_t* pair, int nb, const QuantRows& a, int m0, float* out, size_t ldo) {
  constexpr size_t gbb = group_block_bytes(T);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* lo = pair + 2 * b * gbb;
    const uint8_t* hi = lo + gbb;
    prefetch_ahead(lo, 2 * gbb);
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

// f(std::integral_constant<int, R>{}, m0) over rows in as few tiles of at most MaxR rows as
// there can be, their sizes within one of each other (9 rows in tiles of 8 go 5 + 4, not 8 + 1:
// a tile unpacks the weights again, and a 1-row tile's few dpbusd chains wait on each other).
template <int MaxR, typename F>
void row_tiles(int rows, F f) {
  if (rows <= 0) return;
  const int tiles = (rows + MaxR - 1) / MaxR, base = rows / tiles, longer = rows % tiles;
  for (int t = 0, m = 0; t < tiles; ++t) {
    const int r = base + (t < longer ? 1 : 0);
    with_constant<MaxR>(r, [&](auto tile) { f(tile, m); });
    m += r;
  }
}

#ifdef CPU_ISA_AMX
#include "matmul_amx.hpp"
#endif

template <WeightType T>
void matmul_typed(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
  const int nb = w.k / kBlock;
  [[maybe_unused]] int tiled = 0;  // rows the AMX tiles did, in every whole pair
#ifdef CPU_ISA_AMX
  if (rows >= kAmxMinRows) tiled = amx_tiles<T>(w, a, rows, g0, g1, out, ldo);
#endif
  for (int g = g0; g < g1;) {
    const uint8_t* group = group_start(w, g);
    float* o = out + g * kGroupCols;
#ifdef CPU_ISA_AVX512
    if (g % 2 == 0 && g + 1 < g1) {  // a whole pair (the last group may stand alone)
      row_tiles<kPairTileRows>(rows - tiled, [&](auto tile, int m) {
        pair_rows<T, decltype(tile)::value>(group, nb, a, tiled + m, o, ldo);
      });
      g += 2;
      continue;
    }
#endif
    const size_t stride = group_stride(w, g);
    row_tiles<4>(rows, [&](auto tile, int m) { group_rows<T, decltype(tile)::value>(group, stride, nb, a, m, o, ldo); });
    ++g;
  }
}
#endif  // CPU_SIMD

}  // namespace

void matmul(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
#ifdef CPU_SIMD
  if (w.type == WeightType::Q4_1) return matmul_typed<WeightType::Q4_1>(w, a, rows, g0, g1, out, ldo);
  matmul_typed<WeightType::Q8_0>(w, a, rows, g0, g1, out, ldo);
#else
  matmul_scalar(w, a, rows, g0, g1, out, ldo);
#endif
}

}  // namespace ISA_NS
}  // namespace cpu
