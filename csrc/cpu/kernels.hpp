// The CPU forward's hot kernels, one table per instruction set, chosen at run time.
//
// Weights stay in GGUF's own blocks of 32 (Q4_1: fp16 scale d, fp16 min m, 16 bytes of
// nibbles; Q8_0: fp16 scale d, 32 int8), regrouped once at load so that the blocks of 8
// consecutive output columns sit together ("a column group"), interleaved 4 bytes per column:
// one register then holds 4 consecutive weights of each of the 8 columns, and the integer dot
// product against a broadcast 4-byte run of activations lands each column's sum in its own
// lane (no horizontal sums). Activations are quantised per row in blocks of 32 (int8, fp32
// scale d, d * sum(q)). Each block's integer dot product is exact, and the float side of every
// (row, column) is the same chain of fmas over blocks in order, on every path: a row's result
// never depends on the other rows of the step, on the thread count, or (bitwise, by
// construction) on the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cpu {

enum class WeightType : int { Q4_1 = 3, Q8_0 = 8 };  // GGML type numbers

constexpr int kGroupCols = 8;  // output columns per column group

// Bytes of one GGUF block, and of one column group's block (kGroupCols blocks, scales first).
constexpr size_t gguf_block_bytes(WeightType t) { return t == WeightType::Q4_1 ? 20 : 34; }
constexpr size_t group_block_bytes(WeightType t) { return t == WeightType::Q4_1 ? 160 : 272; }

// Q4_1 group block: uint16 d[8], uint16 m[8], uint8 qs[4][32] where byte qs[i][4c + e] holds
//   column c's element 4i + e in its low nibble and element 16 + 4i + e in its high nibble
//   (GGUF's byte 4i + e of that column, moved, not changed).
// Q8_0 group block: uint16 d[8], int8 qs[8][32] where qs[j][4c + e] is column c's element 4j + e.

// Per-row quantised activations: q [rows][k] int8; d, s and sum [rows][k / 32].
struct QuantRows {
  const int8_t* q;
  const float* d;
  const float* s;       // d * sum(q) per block (Q4_1's min term)
  const int32_t* sum;   // sum(q) per block
  int k;
};

// A weight matrix [n, k] in column groups; n % 8 == 0, k % 32 == 0. The groups go in pairs
// whose blocks alternate (block b of group 2p, then block b of group 2p + 1), so a kernel
// that takes 16 columns at once reads one stream; an odd last group stands alone.
struct PackedMatrix {
  WeightType type;
  int n, k;
  const uint8_t* data;  // (n / 8) * (k / 32) group blocks
};

// Column group g's block 0, and the bytes from one of its blocks to the next.
inline size_t group_offset(WeightType t, int k, int g) {
  const size_t pair_bytes = 2 * static_cast<size_t>(k / 32) * group_block_bytes(t);
  return static_cast<size_t>(g / 2) * pair_bytes + (g % 2) * group_block_bytes(t);
}
inline size_t group_stride(WeightType t, int n, int g) {
  const bool paired = (g | 1) < n / kGroupCols;
  return (paired ? 2 : 1) * group_block_bytes(t);
}
inline const uint8_t* group_start(const PackedMatrix& w, int g) { return w.data + group_offset(w.type, w.k, g); }
inline size_t group_stride(const PackedMatrix& w, int g) { return group_stride(w.type, w.n, g); }

// One KV head of one sequence in the paged fp16 cache: its positions [32b, 32b + 32) are in
// page pages[b], whose K^T ([hd][32]) starts at k + pages[b] * page_stride and whose V
// ([32][hd]) at v + pages[b] * page_stride.
struct KvPages {
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* pages;
  size_t page_stride;
  const uint16_t* k_block(int b) const { return k + static_cast<size_t>(pages[b]) * page_stride; }
  const uint16_t* v_block(int b) const { return v + static_cast<size_t>(pages[b]) * page_stride; }
};

struct Kernels {
  const char* name;
  // out[m][c] for rows [0, rows) and column groups [g0, g1); ldo = row stride of out.
  void (*matmul)(const PackedMatrix& w, const QuantRows& a, int rows, int g0, int g1, float* out,
                 size_t ldo);
  // Attention of `rows` consecutive rows of one span against one KV head, over chunk `chunk`
  // (positions [chunk * kChunk, (chunk + 1) * kChunk)) of that head's pages (KvPages). Row r's
  // `group` query heads (already scaled) are at q + r * q_stride; it attends positions below
  // first_n_pos + r. Writes each (row, head)'s online-softmax state (numerics.hpp) to
  // states + (r * group + h) * state_floats(hd): per block of 32 in order, each score a chain
  // of fmas over hd; a row with no position in the chunk gets the empty state.
  void (*attend_chunk)(const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
                       const KvPages& kv, int chunk, float* states, float* scratch);
  // numerics.hpp's merge_state of parts[i] into totals[i] for i < count, in this path's
  // instructions (generic code, built without FMA, would make each fma a libm call).
  void (*merge_states)(float* const* totals, const float* const* parts, int count, int hd);
  // out[i] = silu(g[i]) * u[i].
  void (*silu_mul)(const float* g, const float* u, float* out, int n);
  // out = rms_norm(x) * w over n values (n % 8 == 0).
  void (*rms_norm)(const float* x, const float* w, int n, float eps, float* out);
  // Per-row quantisation of x [k] (k % 32 == 0) into q [k] and per block d, s = d * sum, sum.
  void (*quantize_row)(const float* x, int k, int8_t* q, float* d, float* s, int32_t* sum);
  // out[i * stride] = fp16(x[i]) for i < n, rounded to nearest even (numerics.hpp's float_to_half).
  void (*to_half)(const float* x, int n, uint16_t* out, size_t stride);
};

// "scalar", "avx2", "avx512", "amx": the paths compiled in, and which this CPU can run ("amx"
// also asks the OS for the tile state, once per process).
const Kernels* kernels_by_name(const std::string& name);  // nullptr if unknown
bool cpu_supports(const std::string& name);
std::string best_isa();  // SPECSERVE_CPU_ISA overrides (scalar | avx2 | avx512 | amx)

constexpr int kAttendRows = 32;     // most rows per attention call
constexpr int kRowsPerKvPass = 4;   // most rows a path attends at once per K/V block
size_t attend_chunk_scratch_floats(int group);
size_t attend_scratch_floats(int group, int hd);  // attend's: the chunk's and two state buffers

// The whole attention of `rows` rows (arguments as attend_chunk's): every chunk, merged in
// order, into out + r * out_stride ([group][hd] per row).
void attend(const Kernels& kernels, const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
            const KvPages& kv, float* out, size_t out_stride, float* scratch);

}  // namespace cpu
