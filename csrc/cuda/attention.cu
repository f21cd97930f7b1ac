// The row-invariant attention kernel (see attention.hpp for the contract).
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "attention.hpp"

namespace cuda_forward {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kAll = 0xffffffffu;

// Butterfly reductions: every lane ends with the same bits (each pairwise step is
// commutative), and the order depends on nothing but the lane layout.
__device__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kAll, v, offset));
  return v;
}

__device__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kAll, v, offset);
  return v;
}

// kDims = head_dim / 32: the output dimensions each lane owns (lane, lane + 32, ...).
template <int kDims>
__global__ void attention_kernel(const float* __restrict__ q, int64_t q_row_stride,
                                 const float* __restrict__ k_cache, const float* __restrict__ v_cache,
                                 float* __restrict__ out, const int32_t* __restrict__ row_slot,
                                 const int32_t* __restrict__ row_pos, int32_t heads, int32_t group,
                                 int32_t kv_heads, int32_t slots, int32_t max_seq_len, float scale) {
  constexpr int kHeadDim = kDims * kWarp;
  __shared__ float q_shared[kHeadDim];
  const int64_t row = blockIdx.x;
  const int32_t head = blockIdx.y;
  const int lane = threadIdx.x;
  float* o = out + (row * heads + head) * kHeadDim;
  const int32_t pos = row_pos[row];
  const int32_t slot = row_slot[row];
  if (pos < 0 || pos >= max_seq_len || slot < 0 || slot >= slots) {
    for (int j = 0; j < kDims; ++j) o[lane + j * kWarp] = 0.0f;
    return;
  }
  const float* q_row = q + row * q_row_stride + static_cast<int64_t>(head) * kHeadDim;
  for (int j = 0; j < kDims; ++j) q_shared[lane + j * kWarp] = q_row[lane + j * kWarp];
  __syncwarp();
  const int64_t base_offset = (static_cast<int64_t>(slot) * kv_heads + head / group) * max_seq_len * kHeadDim;
  const float* keys = k_cache + base_offset;
  const float* values = v_cache + base_offset;

  float running_max = -INFINITY, denominator = 0.0f;
  float acc[kDims];
  for (int j = 0; j < kDims; ++j) acc[j] = 0.0f;
  for (int32_t block = 0; block <= pos; block += kWarp) {
    const int32_t key = block + lane;
    float score = -INFINITY;
    if (key <= pos) {
      // 16-byte loads (rows are 128-byte aligned); the sum still runs d = 0, 1, 2, ... in order.
      const float4* k_row = reinterpret_cast<const float4*>(keys + static_cast<int64_t>(key) * kHeadDim);
      float dot = 0.0f;
      for (int d4 = 0; d4 < kHeadDim / 4; ++d4) {
        const float4 k4 = k_row[d4];
        dot = fmaf(q_shared[4 * d4], k4.x, dot);
        dot = fmaf(q_shared[4 * d4 + 1], k4.y, dot);
        dot = fmaf(q_shared[4 * d4 + 2], k4.z, dot);
        dot = fmaf(q_shared[4 * d4 + 3], k4.w, dot);
      }
      score = dot * scale;
    }
    const float new_max = fmaxf(running_max, warp_max(score));
    const float weight = key <= pos ? expf(score - new_max) : 0.0f;
    const float rescale = expf(running_max - new_max);  // 0 on the first block
    denominator = denominator * rescale + warp_sum(weight);
    for (int j = 0; j < kDims; ++j) acc[j] *= rescale;
    const int32_t in_block = min(kWarp, pos - block + 1);
    for (int32_t i = 0; i < in_block; ++i) {
      const float w = __shfl_sync(kAll, weight, i);
      const float* v_row = values + static_cast<int64_t>(block + i) * kHeadDim;
      for (int j = 0; j < kDims; ++j) acc[j] = fmaf(w, v_row[lane + j * kWarp], acc[j]);
    }
    running_max = new_max;
  }
  for (int j = 0; j < kDims; ++j) o[lane + j * kWarp] = acc[j] / denominator;
}

__global__ void write_kv_kernel(const float* __restrict__ k, int64_t k_row_stride, const float* __restrict__ v,
                                int64_t v_row_stride, float* __restrict__ k_cache, float* __restrict__ v_cache,
                                const int32_t* __restrict__ row_slot, const int32_t* __restrict__ row_pos,
                                int32_t kv_heads, int32_t head_dim, int32_t slots, int32_t max_seq_len) {
  const int64_t row = blockIdx.x;
  const int32_t pos = row_pos[row], slot = row_slot[row];
  if (pos < 0 || pos >= max_seq_len || slot < 0 || slot >= slots) return;
  for (int32_t e = threadIdx.x; e < kv_heads * head_dim; e += blockDim.x) {
    const int64_t dst = ((static_cast<int64_t>(slot) * kv_heads + e / head_dim) * max_seq_len + pos) * head_dim +
                        e % head_dim;
    k_cache[dst] = k[row * k_row_stride + e];
    v_cache[dst] = v[row * v_row_stride + e];
  }
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

template <int kDims>
void launch(const AttentionArgs& a) {
  const CacheRows& c = a.cache;
  const dim3 grid(static_cast<unsigned>(c.rows), static_cast<unsigned>(a.heads));
  attention_kernel<kDims><<<grid, kWarp, 0, reinterpret_cast<cudaStream_t>(c.stream)>>>(
      reinterpret_cast<const float*>(a.q), a.q_row_stride, reinterpret_cast<const float*>(c.k_cache),
      reinterpret_cast<const float*>(c.v_cache), reinterpret_cast<float*>(a.out),
      reinterpret_cast<const int32_t*>(c.row_slot), reinterpret_cast<const int32_t*>(c.row_pos),
      static_cast<int32_t>(a.heads), static_cast<int32_t>(a.heads / c.kv_heads),
      static_cast<int32_t>(c.kv_heads), static_cast<int32_t>(c.slots), static_cast<int32_t>(c.max_seq_len),
      a.scale);
}

// What both kernels need of a step and one layer's cache.
void require_geometry(const CacheRows& c) {
  require(c.rows >= 0 && c.rows < (int64_t{1} << 31), "rows must be in [0, 2^31)");
  require(c.kv_heads >= 1, "kv_heads must be >= 1");
  require(c.head_dim % kWarp == 0 && c.head_dim >= kWarp && c.head_dim <= 8 * kWarp,
          "head_dim must be a multiple of 32 in [32, 256], got " + std::to_string(c.head_dim));
  require(c.slots >= 1 && c.max_seq_len >= 1 && c.max_seq_len < (int64_t{1} << 31) &&
              c.slots * c.kv_heads * c.max_seq_len < (int64_t{1} << 40),
          "slots and max_seq_len must be >= 1 (and the cache under 2^40 rows)");
  if (c.rows > 0) require(c.k_cache && c.v_cache && c.row_slot && c.row_pos, "null device pointer");
}

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(kernel) + " kernel launch: " + cudaGetErrorString(err));
}

}  // namespace

void attention_rows(const AttentionArgs& a) {
  require_geometry(a.cache);
  require(a.heads >= 1 && a.heads <= 65535 && a.heads % a.cache.kv_heads == 0,
          "heads must be a multiple of kv_heads in [1, 65535]");
  require(a.q_row_stride >= a.heads * a.cache.head_dim, "q_row_stride must be >= heads * head_dim");
  if (a.cache.rows == 0) return;
  require(a.q && a.out, "null device pointer");
  switch (a.cache.head_dim / kWarp) {
    case 1: launch<1>(a); break;
    case 2: launch<2>(a); break;
    case 3: launch<3>(a); break;
    case 4: launch<4>(a); break;
    case 5: launch<5>(a); break;
    case 6: launch<6>(a); break;
    case 7: launch<7>(a); break;
    default: launch<8>(a); break;
  }
  check_launch("attention");
}

void write_kv(const KvWriteArgs& a) {
  const CacheRows& c = a.cache;
  require_geometry(c);
  require(a.k_row_stride >= c.kv_heads * c.head_dim && a.v_row_stride >= c.kv_heads * c.head_dim,
          "k_row_stride and v_row_stride must be >= kv_heads * head_dim");
  if (c.rows == 0) return;
  require(a.k && a.v, "null device pointer");
  write_kv_kernel<<<static_cast<unsigned>(c.rows), 128, 0, reinterpret_cast<cudaStream_t>(c.stream)>>>(
      reinterpret_cast<const float*>(a.k), a.k_row_stride, reinterpret_cast<const float*>(a.v), a.v_row_stride,
      reinterpret_cast<float*>(c.k_cache), reinterpret_cast<float*>(c.v_cache),
      reinterpret_cast<const int32_t*>(c.row_slot), reinterpret_cast<const int32_t*>(c.row_pos),
      static_cast<int32_t>(c.kv_heads), static_cast<int32_t>(c.head_dim), static_cast<int32_t>(c.slots),
      static_cast<int32_t>(c.max_seq_len));
  check_launch("write_kv");
}

}  // namespace cuda_forward
