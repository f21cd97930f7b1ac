// The amx path's matmul tiles. Part of matmul_isa.cpp: included there, inside its namespace,
// when CMake builds the amx set (CPU_ISA_AMX), after pair_rows and the helpers it reuses.
#pragma once

// AMX-INT8, for steps of many rows (a prefill, a big batch). One tile instruction computes the
// exact int32 sums of 16 rows' activation block against a pair's block (16 columns): what 8
// dpbusd per row compute in pair_rows. The float side is pair_rows' own, per (row, column) one
// fma chain over the blocks in order, so the results are bitwise those of every other path.
//
// A tile's result is only readable through memory, so the work is staged: a pair's blocks are
// unpacked into tile layout once, then for each tile of 16 rows the tile unit fills a stage of
// kStageBlocks blocks' sums (two blocks in flight) while the vector unit folds the previous
// stage's into the fma chains. Measured on a Xeon with AMX (one thread, a 3072 x 576 Q4_1
// matrix in cache): as fast as pair_rows at 16 rows (unpacking and the trips through memory
// cost what the tiles save), 1.5x at 32, 1.6x at 64 (the per-block float side, which both do,
// bounds it). So tiles start at 32 rows; a whole step (attention, norms and weight reads
// unchanged, 2 threads, 1,000 tokens of context) is 5-7% faster at 32-128 rows and a
// 1,000-token prefill 740 -> 650 ms.
constexpr int kTileRows = 16;
constexpr int kAmxMinRows = 32;
constexpr int kStageBlocks = 8;
constexpr size_t kTileBytes = kBlock / 4 * 64;  // one block of a pair in tile layout: [8][64]

struct TileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

// Tiles 0, 1: C int32 [16][16]; 2, 3: A int8 [16][32]; 4, 5: B [8][64] (chunk j in row j).
void load_tile_config() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = c.rows[2 + t] = kTileRows;
    c.colsb[t] = 64;
    c.colsb[2 + t] = kBlock;
    c.rows[4 + t] = kBlock / 4;
    c.colsb[4 + t] = 64;
  }
  // GCC 12 does not see that ldtilecfg reads c, and would drop the stores above.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

template <WeightType T>
void unpack_pair(const uint8_t* pair, int nb, int8_t* b_tiles) {
  constexpr size_t gbb = group_block_bytes(T);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* lo = pair + 2 * b * gbb;
    prefetch_ahead(lo, 2 * gbb);
    const PairChunks<T> w(lo, lo + gbb, /*q8_as_u8=*/false);
    for (int j = 0; j < kBlock / 4; ++j) _mm512_store_si512(b_tiles + b * kTileBytes + 64 * j, w.w[j]);
  }
}

// Block b's sums into c [16][16], on tiles (0, 2, 4) or (1, 3, 5): two blocks in flight. (The
// intrinsics paste the tile number into the instruction: it must be a literal.)
#define AMX_BLOCK_SUMS(C, A, B)                                                  \
  do {                                                                           \
    _tile_loadd(A, a_rows + b * kBlock, lda);                                    \
    _tile_loadd(B, b_tiles + b * kTileBytes, 64);                                \
    _tile_zero(C);                                                               \
    if constexpr (T == WeightType::Q4_1) _tile_dpbsud(C, A, B); /* s8 x u8 */    \
    else _tile_dpbssd(C, A, B);                                                  \
    _tile_stored(C, c, 64);                                                      \
  } while (0)

template <WeightType T, bool Odd>
void block_sums(const int8_t* a_rows, int lda, const int8_t* b_tiles, int b, int32_t* c) {
  if constexpr (Odd) AMX_BLOCK_SUMS(1, 3, 5);
  else AMX_BLOCK_SUMS(0, 2, 4);
}
#undef AMX_BLOCK_SUMS

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Rows [m0, m0 + 16) against one pair whose blocks are unpacked in b_tiles; c: two stages.
template <WeightType T>
void amx_pair_rows(const uint8_t* pair, const int8_t* b_tiles, int nb, const QuantRows& a, int m0, float* out,
                   size_t ldo, int32_t* c) {
  constexpr size_t gbb = group_block_bytes(T), block_ints = kTileRows * 16;
  const int8_t* a_rows = a.q + static_cast<size_t>(m0) * a.k;
  auto stage_sums = [&](int stage) {  // its blocks' sums into c's half stage % 2
    int32_t* sums = c + (stage % 2) * kStageBlocks * block_ints;
    const int b0 = stage * kStageBlocks, b1 = std::min(nb, b0 + kStageBlocks);
    int b = b0;
    for (; b + 1 < b1; b += 2) {
      block_sums<T, false>(a_rows, a.k, b_tiles, b, sums + (b - b0) * block_ints);
      block_sums<T, true>(a_rows, a.k, b_tiles, b + 1, sums + (b + 1 - b0) * block_ints);
    }
    if (b < b1) block_sums<T, false>(a_rows, a.k, b_tiles, b, sums + (b - b0) * block_ints);
  };
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  const int stages = (nb + kStageBlocks - 1) / kStageBlocks;
  stage_sums(0);
  for (int stage = 0; stage < stages; ++stage) {
    if (stage + 1 < stages) stage_sums(stage + 1);
    const int32_t* sums = c + (stage % 2) * kStageBlocks * block_ints;
    for (int b = stage * kStageBlocks; b < std::min(nb, (stage + 1) * kStageBlocks); ++b, sums += block_ints) {
      const uint8_t* lo = pair + 2 * b * gbb;
      const __m512 dw = load_pair_halves(lo, lo + gbb);
      __m512 mw = _mm512_setzero_ps();
      if constexpr (T == WeightType::Q4_1) mw = load_pair_halves(lo + 16, lo + gbb + 16);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
        const size_t at = static_cast<size_t>(m0 + r) * nb + b;
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * 16));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[at])), isum, acc[r]);
        if constexpr (T == WeightType::Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[at]), acc[r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) _mm512_storeu_ps(out + static_cast<size_t>(m0 + r) * ldo, acc[r]);
}
#pragma GCC diagnostic pop

template <typename P>
P* align64(P* p) {
  return reinterpret_cast<P*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// Rows [0, return value), in tiles of 16, against the whole pairs of groups [g0, g1); the
// rows left and a group without its partner are the AVX-512 kernels'.
template <WeightType T>
int amx_tiles(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out, size_t ldo) {
  const int nb = w.k / kBlock, tiled = rows / kTileRows * kTileRows;
  // Per thread, kept between calls: a pair's blocks in tile layout, and two stages of sums.
  thread_local std::vector<int8_t> b_tiles_buffer;
  thread_local std::vector<int32_t> sums_buffer(2 * kStageBlocks * kTileRows * 16 + 16);
  b_tiles_buffer.resize(std::max(b_tiles_buffer.size(), nb * kTileBytes + 64));
  int8_t* b_tiles = align64(b_tiles_buffer.data());
  load_tile_config();
  for (int g = g0 + g0 % 2; g + 1 < g1; g += 2) {
    const uint8_t* pair = group_start(w, g);
    unpack_pair<T>(pair, nb, b_tiles);
    for (int m = 0; m < tiled; m += kTileRows)
      amx_pair_rows<T>(pair, b_tiles, nb, a, m, out + g * kGroupCols, ldo, align64(sums_buffer.data()));
  }
  _tile_release();
  return tiled;
}
