#include "attention_plan.hpp"

#include <algorithm>

#include "kernels.hpp"
#include "llama_forward.hpp"
#include "numerics.hpp"

namespace cpu {
namespace {

// Chunk tasks are made when a step has fewer (tile, KV head) tasks than this many per thread.
constexpr int kSplitBelowTasksPerThread = 2;

// `pieces` tiles per span, of near-equal size (a span's pieces are capped at its rows and cut
// at most kAttendRows rows each).
std::vector<RowTile> tile_spans(const Span* spans, int num_spans, int pieces) {
  std::vector<RowTile> out;
  for (int i = 0, first = 0; i < num_spans; first += spans[i].length, ++i) {
    const int len = spans[i].length;
    const int count = std::max({1, std::min(pieces, len), (len + kAttendRows - 1) / kAttendRows});
    for (int p = 0, t = 0; p < count; ++p) {
      const int rows = len * (p + 1) / count - len * p / count;
      out.push_back({spans[i].slot, first + t, spans[i].start + t, rows});
      t += rows;
    }
  }
  return out;
}

}  // namespace

AttentionPlan plan_attention(const Span* spans, int num_spans, int n, int kvh, int group, int hd, int threads) {
  AttentionPlan plan;
  const int enough_tasks = kSplitBelowTasksPerThread * threads;
  plan.tiles = tile_spans(spans, num_spans, 1);
  // Few (tile, KV head) tasks (a decode, a verify) leave threads idle. A span of at least
  // kRowsPerKvPass rows a thread is cut into that many tiles, each sharing its K/V blocks among
  // kRowsPerKvPass rows or more (a verify of 8 rows on 2 threads: 2 tiles). Else chunks are
  // split (the chunk states of an 8-row verify, passed between threads, cost as much as a
  // tenth of its attention).
  if (static_cast<int>(plan.tiles.size()) * kvh < enough_tasks) {
    int widest = 0;
    for (int i = 0; i < num_spans; ++i) widest = std::max(widest, spans[i].length);
    const int pieces = std::min(threads, widest / kRowsPerKvPass);
    if (pieces > 1) plan.tiles = tile_spans(spans, num_spans, pieces);
  }
  plan.split_chunks = static_cast<int>(plan.tiles.size()) * kvh < enough_tasks;
  if (!plan.split_chunks) return plan;
  const int sf = state_floats(hd);
  plan.row_tile.resize(n);
  for (int i = 0; i < static_cast<int>(plan.tiles.size()); ++i) {
    const RowTile& t = plan.tiles[i];
    plan.tile_tasks.push_back(static_cast<int>(plan.chunk_tasks.size()));
    plan.tile_chunks.push_back((t.first_pos + t.rows - 1) / kChunk + 1);
    std::fill(plan.row_tile.begin() + t.first_row, plan.row_tile.begin() + t.first_row + t.rows, i);
    for (int head = 0; head < kvh; ++head)
      for (int c = 0; c < plan.tile_chunks.back(); ++c) {
        plan.chunk_tasks.push_back({i, head, c, plan.chunk_state_floats});
        plan.chunk_state_floats += static_cast<size_t>(t.rows) * group * sf;
      }
  }
  return plan;
}

}  // namespace cpu
