#!/usr/bin/env bash
# Cross-compiles the CPU kernels and their native test driver (tests/native/test_kernels.cpp) for
# aarch64 and runs it under qemu-user, checking every NEON kernel against the scalar reference.
#
# The build is the one CMakeLists.txt makes on aarch64: everything for the armv8-a baseline, and
# kernels_dotprod_neon.cpp again with -march=armv8.2-a+dotprod, chosen at run time when the CPU has
# the dot-product instructions. The driver runs twice: on qemu's "max" CPU (dotprod: the vdotq_s32
# kernels) and on an emulated Cortex-A53 (no dotprod: the widening-multiply fallback; a stray sdot
# there would trap).
#
# Installs nothing. Needs Debian's cross compiler and qemu-user:
#   apt-get install -y g++-aarch64-linux-gnu qemu-user
# Usage: tools/checks/neon_check.sh [build dir, default build/neon-check]   (NEON_CHECK_OPT=-O3: CMake's level)
set -euo pipefail
cd "$(dirname "$0")/../.."

CXX="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
QEMU="${QEMU_AARCH64:-qemu-aarch64}"
SYSROOT="${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"
out="${1:-build/neon-check}"
for tool in "$CXX" "$QEMU"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "neon_check: $tool not found; install it with: apt-get install -y g++-aarch64-linux-gnu qemu-user" >&2
    exit 2
  fi
done

# The kernels as CMakeLists.txt selects them on aarch64 (quant/, cpu/kernels/ and cpu/system/, minus the
# x86 variants): the scalar reference, the dispatcher and the NEON files; not the CPU backend, the model,
# tokenizer or GGUF code.
sources=()
for s in native/src/quant/*.cpp native/src/cpu/kernels/*.cpp native/src/cpu/system/*.cpp; do
  [[ "$s" == *_avx*.cpp ]] || sources+=("$s")  # every x86 variant (avx2, avxvnni, avx512*)
done
sources+=(tests/native/test_kernels.cpp)
flags="-std=gnu++17 ${NEON_CHECK_OPT:--O2} -DOPTIML_ARM=1 -Inative/include -Inative/src -Wall -Wextra -Wno-unused-parameter
       -fno-math-errno -Werror"

start=$(date +%s)
rm -rf "$out/obj"
mkdir -p "$out/obj"
# One compile job per file, two at a time (make-like, no build system needed).
for s in "${sources[@]}"; do
  march=armv8-a
  [[ "$s" == *_dotprod_neon.cpp ]] && march=armv8.2-a+dotprod
  echo "$march $s"
done | CXX="$CXX" FLAGS="$flags" OUT="$out/obj" xargs -P "${NEON_CHECK_JOBS:-2}" -L 1 bash -c \
  '$CXX $FLAGS -march="$0" -c "$1" -o "$OUT/$(echo "$1" | tr / _).o"'
# The core as an archive, so only what the driver uses is linked.
AR="${AR_AARCH64:-aarch64-linux-gnu-ar}"
rm -f "$out/libcore.a"
"$AR" rcs "$out/libcore.a" $(ls "$out"/obj/*.o | grep -v tests_native_test_kernels)
"$CXX" -o "$out/test_kernels" "$out/obj/tests_native_test_kernels.cpp.o" "$out/libcore.a" -pthread
echo "neon_check: built in $(( $(date +%s) - start ))s"

status=0
echo "== NEON on a CPU with dotprod (qemu -cpu max)"
"$QEMU" -L "$SYSROOT" -cpu max "$out/test_kernels" neon || status=1
echo "== NEON on a CPU without dotprod (qemu -cpu cortex-a53)"
"$QEMU" -L "$SYSROOT" -cpu cortex-a53 "$out/test_kernels" neon || status=1
echo "neon_check: done in $(( $(date +%s) - start ))s"
exit $status
