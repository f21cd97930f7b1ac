// OwnedMatrix: GGUF rows regrouped into the column groups every kernel reads (kernels.hpp),
// once at load; and a row read back as floats.
#include <algorithm>

#include "llama_forward.hpp"
#include "numerics.hpp"

namespace cpu {

OwnedMatrix::OwnedMatrix(const GgufMatrix& m) {
  const int nb = m.k / kBlock;
  const bool q4 = m.type == WeightType::Q4_1;
  const size_t src_block = gguf_block_bytes(m.type), dst_block = group_block_bytes(m.type);
  bytes_.resize(static_cast<size_t>(m.n / kGroupCols) * nb * dst_block);
  for (int g = 0; g < m.n / kGroupCols; ++g) {
    const size_t start = group_offset(m.type, m.k, g), stride = group_stride(m.type, m.n, g);
    for (int b = 0; b < nb; ++b) {
      uint8_t* dst = bytes_.data() + start + b * stride;
      for (int c = 0; c < kGroupCols; ++c) {
        const uint8_t* src = m.rows + (static_cast<size_t>(g * kGroupCols + c) * nb + b) * src_block;
        std::copy(src, src + 2, dst + 2 * c);                                      // d
        if (q4) std::copy(src + 2, src + 4, dst + 2 * kGroupCols + 2 * c);         // m
        const uint8_t* qs = src + (q4 ? 4 : 2);
        uint8_t* chunks = dst + (q4 ? 4 : 2) * kGroupCols;
        for (int i = 0; i < (q4 ? 4 : 8); ++i) std::copy(qs + 4 * i, qs + 4 * i + 4, chunks + 32 * i + 4 * c);
      }
    }
  }
  view_ = PackedMatrix{m.type, m.n, m.k, bytes_.data()};
}

void OwnedMatrix::dequantize_row(int r, float* out) const {
  const int nb = view_.k / kBlock, g = r / kGroupCols, c = r % kGroupCols;
  const uint8_t* group = group_start(view_, g);
  const size_t stride = group_stride(view_, g);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk);
    const float d = half_to_float(scales[c]);
    float* o = out + b * kBlock;
    if (view_.type == WeightType::Q4_1) {
      const float m = half_to_float(scales[kGroupCols + c]);
      for (int i = 0; i < 4; ++i)
        for (int e = 0; e < 4; ++e) {
          const uint8_t byte = blk[32 + 32 * i + 4 * c + e];
          o[4 * i + e] = d * static_cast<float>(byte & 0x0F) + m;
          o[16 + 4 * i + e] = d * static_cast<float>(byte >> 4) + m;
        }
    } else {
      const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 16);
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) o[4 * j + e] = d * static_cast<float>(qs[32 * j + 4 * c + e]);
    }
  }
}

}  // namespace cpu
