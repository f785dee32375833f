#!/usr/bin/env bash
# The CUDA backend on the CPU emulator: builds the module with OPTIML_CUDA=EMU (the sources of
# native/src/cuda compiled as C++ against native/src/cuda/emu, each GPU thread a fiber) into
# build/cuda-emu/pkg, next to a copy of the Python sources, and runs tests/test_cuda.py with it. This is
# how the backend's kernels and host logic are tested on machines without a GPU (CI runs it).
# The emulator build checks what an x86 core forgives and a GPU does not: a misaligned load of a 16-byte
# vector type or of a 2- or 4-byte field (a GPU faults, x86 reads it), an index past a fixed array (a GPU
# reads another thread's registers or garbage) and null pointers, with UndefinedBehaviorSanitizer
# (OPTIML_EMU_SANITIZE, default alignment,bounds,null; empty: none); emu.cpp refuses launches no GPU
# accepts (grid or block dimensions past CUDA's limits).
#
#   tools/checks/cuda_emu_check.sh [all|build|run]     (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=build/cuda-emu
pkg=$build/pkg
py="${PYTHON:-python}"
step="${1:-all}"
case "$step" in all|build|run) ;; *) echo "usage: $0 [all|build|run]" >&2; exit 2 ;; esac

if [ "$step" != run ]; then
  mkdir -p "$build"
  checks="${OPTIML_EMU_SANITIZE-alignment,bounds,null}"
  flags=""
  [ -n "$checks" ] && flags="-fsanitize=$checks -fno-sanitize-recover=all"
  cmake -S . -B "$build" -G Ninja -DOPTIML_CUDA=EMU -DPython_EXECUTABLE="$(command -v "$py")" \
    "-DCMAKE_CXX_FLAGS=$flags" \
    -DOPTIML_MODULE_DIR="$PWD/$pkg/optiml" > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
  cmake --build "$build" -j"${OPTIML_EMU_JOBS:-2}"
fi
[ "$step" = build ] && exit 0
ls "$pkg"/optiml/_core* > /dev/null 2>&1 || { echo "no emulator build in $build: run $0 build first" >&2; exit 1; }

# The Python sources next to the emulator's module: a package that imports instead of the installed one.
(cd python/optiml && tar cf - --exclude='_core*' --exclude=__pycache__ .) | tar xf - -C "$pkg/optiml"
[ -f "$pkg/optiml/manifest.json" ] || cp models/manifest.json "$pkg/optiml/manifest.json"
PYTHONPATH="$pkg" "$py" -c "import optiml; d = optiml.system_info()['cuda_devices']; assert d and 'emulator' in d[0]['name'], d"
# Two workers where pytest-xdist is installed (the test extra has it): the emulator runs a kernel's threads on
# one core, and CI's foreground tests leave the second core to this job once they are done.
workers=()
"$py" -c "import xdist" 2> /dev/null && workers=(-n "${OPTIML_EMU_WORKERS:-2}" --dist load)
PYTHONPATH="$pkg" "$py" -m pytest -q tests/test_cuda.py -p no:cacheprovider ${workers[@]+"${workers[@]}"}
