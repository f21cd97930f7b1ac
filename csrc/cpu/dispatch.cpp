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

// K^T and V of one block, then per (row, head): accumulator [hd], running max and sum; scores.
size_t attend_scratch_floats(int group, int hd) {
  return 2 * static_cast<size_t>(kBlock) * hd + static_cast<size_t>(kAttendRows) * group * (hd + 2) + 2 * kBlock;
}

}  // namespace cpu
