// Which kernel table runs: the best this CPU supports, or the one SPECSERVE_CPU_ISA names.
#include <cstdlib>
#include <stdexcept>
#include <vector>

#ifdef CPU_HAVE_X86_PATHS
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.hpp"
#include "numerics.hpp"

namespace cpu {

namespace isa_scalar { extern const Kernels kernels; }
#ifdef CPU_HAVE_X86_PATHS
namespace isa_avx2 { extern const Kernels kernels; }
namespace isa_avx512 { extern const Kernels kernels; }
namespace isa_amx { extern const Kernels kernels; }

namespace {

// AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25), and Linux's leave to use the tile data
// state: a process must ask for it (arch_prctl) before its first tile instruction, or that
// instruction faults. Asking again is harmless, and the answer holds for every thread.
bool amx_int8_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace
#endif

bool cpu_supports(const std::string& name) {
  if (name == "scalar") return true;
#ifdef CPU_HAVE_X86_PATHS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (name == "avx2") return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (name == "avx512") return avx512;
  if (name == "amx") {
    static const bool usable = avx512 && amx_int8_usable();
    return usable;
  }
#endif
  return false;
}

const Kernels* kernels_by_name(const std::string& name) {
  if (name == "scalar") return &isa_scalar::kernels;
#ifdef CPU_HAVE_X86_PATHS
  if (name == "avx2") return &isa_avx2::kernels;
  if (name == "avx512") return &isa_avx512::kernels;
  if (name == "amx") return &isa_amx::kernels;
#endif
  return nullptr;
}

std::string best_isa() {
  if (const char* forced = std::getenv("SPECSERVE_CPU_ISA"); forced != nullptr && *forced != '\0') {
    const std::string name(forced);
    if (kernels_by_name(name) == nullptr) {
      throw std::invalid_argument("SPECSERVE_CPU_ISA=" + name + ": must be scalar, avx2, avx512 or amx");
    }
    if (!cpu_supports(name)) throw std::invalid_argument("SPECSERVE_CPU_ISA=" + name + ": this CPU cannot run it");
    return name;
  }
  for (const char* name : {"amx", "avx512", "avx2"})
    if (cpu_supports(name)) return name;
  return "scalar";
}

// The scores of the group's heads and their rescale factors, for the rows a path takes at once.
size_t attend_chunk_scratch_floats(int group) {
  return kRowsPerKvPass * static_cast<size_t>(group) * (kBlock + 1);
}

size_t attend_scratch_floats(int group, int hd) {
  return attend_chunk_scratch_floats(group) + 2 * static_cast<size_t>(kAttendRows) * group * state_floats(hd);
}

void attend(const Kernels& kernels, const float* q, size_t q_stride, int rows, int first_n_pos, int group, int hd,
            const KvPages& kv, float* out, size_t out_stride, float* scratch) {
  const int sf = state_floats(hd), states = rows * group;
  float* total = scratch;
  float* part = total + static_cast<size_t>(kAttendRows) * group * sf;
  float* chunk_scratch = part + static_cast<size_t>(kAttendRows) * group * sf;
  const int chunks = (first_n_pos + rows - 1 + kChunk - 1) / kChunk;
  std::vector<float*> totals(states);
  std::vector<const float*> parts(states);
  for (int i = 0; i < states; ++i) {
    totals[i] = total + i * sf;
    parts[i] = part + i * sf;
  }
  kernels.attend_chunk(q, q_stride, rows, first_n_pos, group, hd, kv, 0, total, chunk_scratch);
  for (int c = 1; c < chunks; ++c) {
    kernels.attend_chunk(q, q_stride, rows, first_n_pos, group, hd, kv, c, part, chunk_scratch);
    kernels.merge_states(totals.data(), parts.data(), states, hd);
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < group; ++h) finish_state(total + (r * group + h) * sf, hd, out + r * out_stride + h * hd);
}

}  // namespace cpu
