// SYNCD_CLONES: compile a portable function once per x86-64 level (v4: AVX-512, v3: AVX2 with BMI and POPCNT,
// and the baseline), the loader picking the best the CPU runs. GCC only; empty elsewhere and in the sanitizer
// build (SYNCD_NO_MULTIVERSION).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(SYNCD_NO_MULTIVERSION)
#define SYNCD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SYNCD_CLONES
#endif
