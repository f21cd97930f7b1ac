// Which kernel table runs: the best this CPU supports, or the one SPECSERVE_CPU_ISA names.
#include <cstdlib>
#include <stdexcept>

#include "kernels.hpp"
#include "numerics.hpp"

namespace cpu {

namespace isa_scalar { extern const Kernels kernels; }
#ifdef CPU_HAVE_X86_PATHS
namespace isa_avx2 { extern const Kernels kernels; }
namespace isa_avx512 { extern const Kernels kernels; }
#endif

bool cpu_supports(const std::string& name) {
  if (name == "scalar") return true;
#ifdef CPU_HAVE_X86_PATHS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (name == "avx2") return avx2;
  if (name == "avx512") {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
#endif
  return false;
}

const Kernels* kernels_by_name(const std::string& name) {
  if (name == "scalar") return &isa_scalar::kernels;
#ifdef CPU_HAVE_X86_PATHS
  if (name == "avx2") return &isa_avx2::kernels;
  if (name == "avx512") return &isa_avx512::kernels;
#endif
  return nullptr;
}

std::string best_isa() {
  if (const char* forced = std::getenv("SPECSERVE_CPU_ISA"); forced != nullptr && *forced != '\0') {
    const std::string name(forced);
    if (kernels_by_name(name) == nullptr) {
      throw std::invalid_argument("SPECSERVE_CPU_ISA=" + name + ": must be scalar, avx2 or avx512");
    }
    if (!cpu_supports(name)) throw std::invalid_argument("SPECSERVE_CPU_ISA=" + name + ": this CPU cannot run it");
    return name;
  }
  for (const char* name : {"avx512", "avx2"})
    if (cpu_supports(name)) return name;
  return "scalar";
}

// The scores of the group's heads and their rescale factors.
size_t attend_chunk_scratch_floats(int group) {
  return static_cast<size_t>(group) * (kBlock + 1);
}

size_t attend_scratch_floats(int group, int hd) {
  return attend_chunk_scratch_floats(group) + 2 * static_cast<size_t>(kAttendRows) * group * state_floats(hd);
}

void attend(const Kernels& kernels, const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
            const uint16_t* k, const uint16_t* v, float* out, size_t out_stride, float* scratch) {
  const int sf = state_floats(hd), states = rows * group;
  float* total = scratch;
  float* part = total + static_cast<size_t>(kAttendRows) * group * sf;
  float* chunk_scratch = part + static_cast<size_t>(kAttendRows) * group * sf;
  const int chunks = (first_n_pos + rows - 1 + kChunk - 1) / kChunk;
  kernels.attend_chunk(q, q_stride, rows, first_n_pos, group, hd, k, v, 0, total, chunk_scratch);
  for (int c = 1; c < chunks; ++c) {
    kernels.attend_chunk(q, q_stride, rows, first_n_pos, group, hd, k, v, c, part, chunk_scratch);
    for (int i = 0; i < states; ++i) kernels.merge_state(total + i * sf, part + i * sf, hd);
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < group; ++h) finish_state(total + (r * group + h) * sf, hd, out + r * out_stride + h * hd);
}

}  // namespace cpu
