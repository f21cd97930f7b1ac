// The canonical scalar arithmetic of the CPU forward.
//
// Every kernel path (scalar, AVX2, AVX-512) computes exactly these operations in exactly this
// order, so their results agree bit for bit: a SIMD path may only vectorise over independent
// elements, or over the 8 "lanes" that the reductions below define. fp16 <-> fp32 is done in
// software with round-to-nearest-even, which is what F16C does in hardware.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#else
#include <cfenv>
#endif

namespace cpu {
// Internal linkage: each translation unit keeps its own copies, compiled with its own
// instruction set. With ordinary inline linkage the linker keeps one out-of-line copy for all,
// and an AVX-512 translation unit's copy could be what a generic one calls.
namespace {

constexpr int kBlock = 32;  // values per quantisation block (GGUF's QK4_1 / QK8_0)
constexpr int kLanes = 8;   // lanes of a canonical reduction (one AVX2 register of floats)

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// IEEE half -> float; exact for every input, subnormals included.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf/nan
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  int shift = 0;  // subnormal half: normalise
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return bits_to_float(sign | ((113u - shift) << 23) | ((mantissa & 0x3FFu) << 13));
}

// float -> IEEE half, round to nearest even (as vcvtps2ph with _MM_FROUND_TO_NEAREST_INT).
inline uint16_t float_to_half(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits >= 0x7F800000u) {  // inf or nan (keep nan quiet)
    return sign | 0x7C00u | (abs_bits > 0x7F800000u ? 0x200u | ((abs_bits >> 13) & 0x3FFu) : 0u);
  }
  if (abs_bits >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: overflow to inf
  if (abs_bits < 0x38800000u) {                         // below the smallest normal half
    if (abs_bits < 0x33000000u) return sign;            // below half the smallest subnormal
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs_bits >> 13) - (112u << 10));
  const uint32_t rest = abs_bits & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into exponent
  return sign | static_cast<uint16_t>(half);
}

// max and min as the SIMD instructions define them (the second operand unless the first
// compares greater / less); std::fmax would be a libm call with other NaN rules.
inline float max_canonical(float a, float b) { return a > b ? a : b; }
inline float min_canonical(float a, float b) { return a < b ? a : b; }

// Horizontal sum of 8 lanes in the order an AVX2 register is folded:
// (lo128 + hi128), then (lanes 0,1 + lanes 2,3), then lane 0 + lane 1.
inline float hsum8(const float* lane) {
  const float a0 = lane[0] + lane[4], a1 = lane[1] + lane[5];
  const float a2 = lane[2] + lane[6], a3 = lane[3] + lane[7];
  return (a0 + a2) + (a1 + a3);
}

// Dot product of n floats (n a multiple of 8): lane l accumulates elements l, l+8, ... with fma.
inline float dot_canonical(const float* a, const float* b, int n) {
  float lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(a[i + l], b[i + l], lane[l]);
  return hsum8(lane);
}

// exp(x) for the softmax and SiLU: a Cody-Waite reduction to r in [-ln2/2, ln2/2] and a
// degree-5 polynomial (Cephes coefficients), every step an explicit fma or a plain op.
// x is clamped to [-87, 88] so the result stays a normal float (relative error ~2 ulp).
namespace expc {
constexpr float kMin = -87.0f, kMax = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace expc

inline float exp_canonical(float x) {
  using namespace expc;
  x = min_canonical(max_canonical(x, kMin), kMax);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float rr = r * r;
  float y = std::fma(p, rr, r);
  y = y + 1.0f;
  return y * bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// Attention's online softmax, per (row, query head). A state is acc[hd] (the p-weighted sum
// of V rows), then m (the largest score seen) and l (the sum of p = exp(score - m)); its output
// is acc / l. Positions are taken in chunks of kChunk (blocks of 32 in order inside a chunk,
// from a fresh state), and the chunks' states are merged in position order: the chunks of one
// row may run on different threads without changing a bit.
constexpr int kChunk = 128;
constexpr int state_floats(int hd) { return hd + 2; }

// The running sum of one block's p (32 values, zero past the block's last position):
// lane l adds p[l], p[l + 8], p[l + 16], p[l + 24] in order, then the lanes fold as hsum8.
inline float block_sum_canonical(const float* p) {
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = ((p[l] + p[l + 8]) + p[l + 16]) + p[l + 24];
  return hsum8(lane);
}

// total = total merged with part (a later chunk): both rescaled to the larger max, without
// fma. An empty part (no position in its chunk, m = -inf) leaves total as it is.
inline void merge_state(float* total, const float* part, int hd) {
  const float m_part = part[hd];
  if (!(m_part > -INFINITY)) return;
  const float m = max_canonical(total[hd], m_part);
  const float a = exp_canonical(total[hd] - m), b = exp_canonical(m_part - m);
  for (int d = 0; d < hd; ++d) total[d] = total[d] * a + part[d] * b;
  total[hd + 1] = total[hd + 1] * a + part[hd + 1] * b;
  total[hd] = m;
}

inline void finish_state(const float* state, int hd, float* out) {
  for (int d = 0; d < hd; ++d) out[d] = state[d] / state[hd + 1];
}

// silu(g) * u, elementwise.
inline float silu_mul(float g, float u) { return g / (1.0f + exp_canonical(-g)) * u; }

// Canonical RMSNorm: sum of squares over 8 lanes, then x * (1 / sqrt(mean + eps)) * w.
inline float rms_inverse(float sum_squares, int n, float eps) {
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

// Per-row quantisation of one block of 32: scale amax / 127, q = round-half-even(x * 127 / amax).
// A block too small for 127 / amax to be finite (amax under about 3.7e-37) quantises to zeros,
// as an all-zero block does: an infinite inverse made the SIMD paths' q -128 and the scalar's
// conversion undefined.
inline float quant_inverse(float amax) {
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  return std::isfinite(inverse) ? inverse : 0.0f;
}

// A block holding a NaN or an infinity: codes and sum 0, scale and scaled sum NaN, so every
// output it feeds is NaN on every path. (Whether a NaN survives a max depends on the order the
// paths take it in, and the scalar path's conversion of a NaN code was undefined: 0 there,
// -128 on the SIMD paths.)
inline void quantize_non_finite(int8_t* q, float* d, float* s, int32_t* sum) {
  for (int j = 0; j < 32; ++j) q[j] = 0;
  *d = *s = std::numeric_limits<float>::quiet_NaN();
  *sum = 0;
}

// The floating-point environment all of the above assumes, held by a thread while it computes:
// IEEE round-to-nearest-even, no flush-to-zero, no denormals-are-zero. A thread inherits its
// creator's environment, and a library loaded into the process (one built with -ffast-math
// sets FTZ/DAZ as it loads) or the caller may change a thread's: without this, the chunks a
// worker and the calling thread each took of one loop were computed two ways, and a verify's
// rows no longer equalled their one-row decodes. The caller's environment is restored after.
class CanonicalFloatEnv {
 public:
#if defined(__x86_64__) || defined(__i386__)
  CanonicalFloatEnv() : saved_(_mm_getcsr()) { _mm_setcsr(kMxcsr); }
  ~CanonicalFloatEnv() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kMxcsr = 0x1F80;  // every exception masked, round to nearest, no FTZ/DAZ
  unsigned saved_;
#else
  CanonicalFloatEnv() {
    std::fegetenv(&saved_);
    std::fesetenv(FE_DFL_ENV);
  }
  ~CanonicalFloatEnv() { std::fesetenv(&saved_); }

 private:
  std::fenv_t saved_;
#endif
  CanonicalFloatEnv(const CanonicalFloatEnv&) = delete;
  CanonicalFloatEnv& operator=(const CanonicalFloatEnv&) = delete;
};

}  // namespace
}  // namespace cpu
