// Which instruction set the SIMD executor runs: what this CPU supports, what floe::simd
// was compiled for, and the FLOE_SIMD_ARCH override (avx512 | avx2 | scalar).
#pragma once

#include <cstdlib>
#include <string_view>

#include "floe/core/error.hpp"
#include "floe/exec/simd/kernel_api.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace floe {

inline constexpr std::string_view simd_arch_name(simd_arch a) {
  switch (a) {
    case simd_arch::automatic: return "automatic";
    case simd_arch::scalar: return "scalar";
    case simd_arch::avx2: return "avx2";
    case simd_arch::avx512: return "avx512";
  }
  return "unknown";
}

// Parses "avx512", "avx2", "scalar" or "automatic"; `argument` names where it came from.
inline simd_arch parse_simd_arch(std::string_view text, const char* argument = "arch") {
  for (simd_arch a : {simd_arch::automatic, simd_arch::scalar, simd_arch::avx2, simd_arch::avx512})
    if (text == simd_arch_name(a)) return a;
  throw invalid_argument(argument, detail::concat("unknown SIMD architecture '", text,
                                                  "' (expected avx512, avx2, scalar or automatic)"));
}

// True when this CPU and OS can run `a`. avx512 means AVX-512 F/CD/DQ/BW/VL (xsimd's
// avx512bw); avx2 means AVX2 + FMA + F16C. F16C has no __builtin_cpu_supports name in
// every compiler, so it is read from CPUID leaf 1 (ECX bit 29), once: on a VM CPUID
// traps to the hypervisor (cpu_supports took 9.5 us on the 2-core machine, and every
// executor constructed paid it).
inline bool cpu_supports(simd_arch a) {
  if (a == simd_arch::scalar) return true;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  static const bool f16c = [] {
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 29) & 1u);
  }();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (a == simd_arch::avx2) return avx2;
  if (a == simd_arch::avx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return false;
}

// True when floe::simd holds kernels for `a` (it always holds scalar).
inline bool simd_compiled(simd_arch a) { return simd_detail::compiled_kernels(a) != nullptr; }

// The widest architecture both compiled and supported here.
inline simd_arch best_simd_arch() {
  for (simd_arch a : {simd_arch::avx512, simd_arch::avx2})
    if (simd_compiled(a) && cpu_supports(a)) return a;
  return simd_arch::scalar;
}

// automatic -> FLOE_SIMD_ARCH when set, else the best; an explicit choice must be both
// compiled and supported, or it is rejected naming where it came from.
inline simd_arch resolve_simd_arch(simd_arch requested) {
  const char* argument = "arch";
  if (requested == simd_arch::automatic) {
    const char* env = std::getenv("FLOE_SIMD_ARCH");
    if (env == nullptr || *env == '\0') return best_simd_arch();
    argument = "FLOE_SIMD_ARCH";
    requested = parse_simd_arch(env, argument);
    if (requested == simd_arch::automatic) return best_simd_arch();
  }
  require(simd_compiled(requested), argument, "floe::simd was built without ", simd_arch_name(requested),
          " kernels (see FLOE_SIMD_TARGETS)");
  require(cpu_supports(requested), argument, "this CPU does not support ", simd_arch_name(requested));
  return requested;
}

}  // namespace floe
