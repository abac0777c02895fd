// FLOWKIT_SIMD_CLONES: a CPU loop function compiled for AVX-512, AVX2 and the baseline, picked at load time by the
// CPU it runs on (GCC's target_clones), so the wheel's -O3 build vectorises for the machine without -march flags.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLOWKIT_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FLOWKIT_SIMD_CLONES
#endif
