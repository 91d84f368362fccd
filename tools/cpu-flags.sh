# Sourced by tools/build-llama-wheel.sh and tools/llama-anchor.sh: the llama.cpp CPU flags.
# Explicit instruction sets, never GGML_NATIVE (a native build on these VMs emits AMX tile
# instructions the hypervisor does not enable: SIGILL). EDGESPEC_CPU=auto (default) adds AVX-512
# when this machine's /proc/cpuinfo lists it (10-30 % faster verification and drafting on the
# EPYC we measured); EDGESPEC_CPU=portable builds AVX2 only (bundles meant for other CPUs).
# Sets CPU_FLAGS (CMake arguments) and CPU_FEATURES (the /proc/cpuinfo flags a build needs).
CPU_FEATURES="avx avx2 fma f16c bmi2"
CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
case "${EDGESPEC_CPU:-auto}" in
  portable) ;;
  auto)
    CPUINFO_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 || true) "
    _have() { [[ "$CPUINFO_FLAGS" == *" $1 "* ]]; }
    if _have avx512f && _have avx512bw && _have avx512vl && _have avx512dq && _have avx512cd; then
      CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512=ON"
      CPU_FEATURES="$CPU_FEATURES avx512f avx512bw avx512vl avx512dq avx512cd"
      if _have avx512vbmi; then CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512_VBMI=ON"; CPU_FEATURES="$CPU_FEATURES avx512vbmi"; fi
      if _have avx512_vnni; then CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512_VNNI=ON"; CPU_FEATURES="$CPU_FEATURES avx512_vnni"; fi
      if _have avx512_bf16; then CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512_BF16=ON"; CPU_FEATURES="$CPU_FEATURES avx512_bf16"; fi
    fi
    ;;
  *) echo "EDGESPEC_CPU must be auto or portable, got '${EDGESPEC_CPU}'" >&2; exit 2 ;;
esac
