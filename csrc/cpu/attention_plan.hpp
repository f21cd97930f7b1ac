// How a step's attention is cut into tasks for the thread pool (llama_forward.cpp runs them).
//
// Attention runs on tiles of a span's consecutive rows, sharing each K/V block among them. A
// (tile, KV head) is one task that takes its chunks of kChunk positions in order and merges
// them itself; where a step has too few such tasks to keep the threads busy (a decode), each
// (tile, KV head) is cut further into chunk tasks, whose states a later loop merges, row by
// row, in the same order. The cut never changes a bit.
#pragma once

#include <cstddef>
#include <vector>

namespace cpu {

struct Span;

struct RowTile {
  int slot, first_row, first_pos, rows;
};

struct ChunkTask {
  int tile, head, chunk;
  size_t states;  // offset of its [rows][group] states in the step's chunk states
};

struct AttentionPlan {
  std::vector<RowTile> tiles;
  bool split_chunks = false;
  // Where chunks are split: the tasks, each row's tile, and a tile's first task and its
  // chunks per KV head.
  std::vector<ChunkTask> chunk_tasks;
  std::vector<int> row_tile, tile_tasks, tile_chunks;
  size_t chunk_state_floats = 0;

  // Offset of row r's state for query head `head` in chunk c (split chunks only).
  size_t chunk_state(int r, int head, int c, int group, int sf) const {
    const int tile = row_tile[r];
    const ChunkTask& task = chunk_tasks[tile_tasks[tile] + (head / group) * tile_chunks[tile] + c];
    return task.states + static_cast<size_t>((r - tiles[tile].first_row) * group + head % group) * sf;
  }
};

// The plan for n rows in `spans`, with `kvh` KV heads of `group` query heads (head_dim hd), on
// `threads` threads.
AttentionPlan plan_attention(const Span* spans, int num_spans, int n, int kvh, int group, int hd, int threads);

}  // namespace cpu
