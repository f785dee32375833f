#!/usr/bin/env bash
# The native code under AddressSanitizer + UndefinedBehaviorSanitizer (GCC or clang, whichever CMake
# picks): builds the core, the Python module and the fuzz harnesses' replay drivers in build/asan
# (-DOPTIML_SANITIZE=ON, -O1), then
#   1. replays the fuzz seeds plus a fixed number of random mutations through the GGUF and tokenizer
#      harnesses (tests/fuzz/replay_main.cpp),
#   2. runs the native-heavy tests -- every kernel against its scalar/numpy reference (test_simd,
#      test_quant, test_matmul, test_sparse_kernels), the GGUF parser (test_gguf), the tokenizers
#      (test_tokenizer) and sampling -- with the sanitized module in place of the normal one (Python
#      itself is not instrumented: libasan comes in through LD_PRELOAD, and leak detection is off because
#      the interpreter never frees some of its memory). The model loader and the forward pass of every
#      layout and weight type in the seeds (F32, F16, Q8_0, Q4_0, Q4_K; llama, qwen2, gemma3; sparse
#      thresholds and placement keys) run in step 1: the GGUF harness loads each input and runs a step.
#      test_generate and test_sparse_ffn are left out for time (6+ minutes under ASan); name extra tests
#      in OPTIML_SANITIZE_TESTS to add them.
# Any sanitizer report stops it with a non-zero status. Run from the repository root:
#     bash tools/checks/sanitize_check.sh            # OPTIML_SANITIZE_RUNS=N mutations per harness (default 2000)
#     bash tools/checks/sanitize_check.sh build      # only the build (.ci/run starts it early, in the background)
#     bash tools/checks/sanitize_check.sh run        # only steps 1 and 2, on an earlier build
set -euo pipefail
cd "$(dirname "$0")/../.."
build=build/asan
pkg=$build/pkg
py="${PYTHON:-python}"
runs="${OPTIML_SANITIZE_RUNS:-2000}"
step="${1:-all}"
case "$step" in all|build|run) ;; *) echo "usage: $0 [all|build|run]" >&2; exit 2 ;; esac

if [ "$step" != run ]; then
  mkdir -p "$build"
  cmake -S . -B "$build" -G Ninja -DOPTIML_CUDA=OFF -DOPTIML_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" -DPython_EXECUTABLE="$(command -v "$py")" \
    -DOPTIML_MODULE_DIR="$PWD/$pkg/optiml" > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
  cmake --build "$build" -j"${OPTIML_SANITIZE_JOBS:-2}"
fi
[ "$step" = build ] && exit 0
[ -f "$build/replay_gguf" ] || { echo "no sanitized build in $build: run $0 build first" >&2; exit 1; }

# The Python sources next to the sanitized module: a package that imports instead of the installed one.
mkdir -p "$pkg/optiml"
(cd python/optiml && tar cf - --exclude='_core*' --exclude=__pycache__ .) | tar xf - -C "$pkg/optiml"
[ -f "$pkg/optiml/manifest.json" ] || cp models/manifest.json "$pkg/optiml/manifest.json"

# libstdc++ preloaded too: ASan intercepts __cxa_throw only when the C++ runtime is there at start-up,
# and the Python interpreter, a C program, would load it only with the module.
libasan="$("${CXX:-c++}" -print-file-name=libasan.so) $("${CXX:-c++}" -print-file-name=libstdc++.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# Python with the sanitized optiml.
asan_py() { PYTHONPATH="$pkg:tests/fuzz" LD_PRELOAD="$libasan" "$py" "$@"; }

seeds=$(mktemp -d)
trap 'rm -rf "$seeds"' EXIT
asan_py tests/fuzz/seeds.py gguf "$seeds/gguf" > /dev/null
for d in tests/fuzz/regressions/gguf; do [ -d "$d" ] && cp "$d"/* "$seeds/gguf/" 2>/dev/null || true; done
echo "== sanitizers: fuzz harness replay ($runs mutations each)"
ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=1" "$build/replay_gguf" "$seeds/gguf" -runs="$runs"
cache="${OPTIML_MODEL_CACHE:-$HOME/.cache/optiml/models}"
toks=""
for m in SmolLM2-135M-Instruct.Q4_1.gguf gemma3-270m-Q4_K_M.gguf; do
  [ -f "$cache/$m" ] && toks="${toks:+$toks:}$cache/$m"
done
if [ -n "$toks" ]; then
  mkdir -p "$seeds/tok"
  asan_py -c "
import targets, sys
for i, s in enumerate(targets.tokenizer_seeds()):
    open(f'$seeds/tok/seed-{i:03d}', 'wb').write(s)"
  [ -d tests/fuzz/regressions/tokenizer ] && cp tests/fuzz/regressions/tokenizer/* "$seeds/tok/"
  OPTIML_FUZZ_TOKENIZERS="$toks" ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=1" "$build/replay_tokenizer" "$seeds/tok" -runs="$runs"
fi

echo "== sanitizers: native-heavy tests with the sanitized module"
asan_py -c "import optiml, sys; assert optiml.__file__.startswith('$PWD/$pkg'), optiml.__file__"
asan_py -m pytest -q -p no:cacheprovider -x --durations=5 \
  tests/test_simd.py tests/test_quant.py tests/test_matmul.py tests/test_sparse_kernels.py tests/test_gguf.py \
  tests/test_tokenizer.py tests/test_sampling.py ${OPTIML_SANITIZE_TESTS:-}
