#!/usr/bin/env bash
# The GPU check of issues #16/#17 in one command, for a machine with a CUDA GPU and no package registry.
#
#   tools/gpu_check.sh prepare   # here, with network: writes build/gpu-carry/ (under 64 MiB): the wheels the
#                                # GPU image lacks, llama.cpp's sources (from llama-cpp-python's sdist), and a
#                                # tokenizer-only GGUF for the synthetic models
#   tools/gpu_check.sh run       # there (carry build/gpu-carry): builds OptiML with CUDA and llama.cpp with
#                                # CUDA, makes synthetic 7B/13B-shaped models, runs the GPU tests (and
#                                # compute-sanitizer's memcheck over the whole-model test), then benchmarks
#                                # against llama.cpp (tools/bench_gpu.py). Real models are used when
#                                # build/gpu-carry/models/*.gguf is there (carry one in parts: *.gguf.part-*
#                                # are joined first).
#   tools/gpu_check.sh hybrid    # there, after run (a warm machine keeps its builds; else they are redone):
#                                # issue #17's benchmark, tools/bench_hybrid.py, for 7B-shaped ReLU (90%
#                                # sparse) and SwiGLU (50%) models with planted power-law firing at 25% and
#                                # 50% of the model in VRAM, against llama.cpp CUDA -ngl at the same memory
#   tools/gpu_check.sh offload   # there (after run, or alone): issue #19's GPU test and benchmark,
#                                # tools/bench_offload.py: the 7B-shaped model served to 16 clients with device
#                                # KV memory for a quarter of them (and for all), GPU-only vs CPU attention
#                                # offload vs llama-server CUDA (built without its web UI: no network there)
#
# `run` writes its logs and tables to $OUT when set (the device tool brings that folder back), else to
# build/gpu-check. It goes on past a failed step and ends with a summary and exit status 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
carry=build/gpu-carry

prepare() {
    set -e
    rm -rf "$carry" && mkdir -p "$carry/wheels" "$carry/models"
    local py=${PYTHON:-python3}
    # The GPU image has numpy, nanobind, scikit-build-core, cmake, ninja, pytest, jinja2, safetensors, tqdm:
    # only what it lacks travels. (cp312: the image's Python.)
    "$py" -m pip download --quiet --no-deps --dest "$carry/wheels" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        gguf highspy prompt_toolkit wcwidth
    local src=${LLAMA_SDIST:-}
    if [ -z "$src" ]; then  # the sdist itself, straight from PyPI (pip download would build its metadata)
        mkdir -p "$carry/sdist"
        src=$carry/sdist/llama_cpp_python.tar.gz
        "$py" - "$src" <<'PYEOF'
import json, sys, urllib.request
info = json.load(urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-python/0.3.36/json"))
url = next(u["url"] for u in info["urls"] if u["packagetype"] == "sdist")
urllib.request.urlretrieve(url, sys.argv[1])
PYEOF
    fi
    local tmp; tmp=$(mktemp -d)
    tar -xzf "$src" -C "$tmp"
    local lc; lc=$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
    tar -C "$lc" -cJf "$carry/llama.cpp.tar.xz" --exclude=./build --exclude=./models --exclude=./docs \
        --exclude=./examples/*/assets --exclude=./tools/server/public* --exclude='*.gguf' .
    rm -rf "$tmp" "$carry/sdist"
    # The synthetic models copy their tokenizer from a donor GGUF: a tiny model with SmolLM2's tokenizer.
    PYTHONPATH=python "$py" tools/make_synthetic_model.py -o "$carry/models/tokenizer-donor.gguf" --quiet \
        --n-embd 64 --n-layer 1 --n-ff 128 --n-head 2 --n-head-kv 2
    du -sh "$carry"
}

out=${OUT:-build/gpu-check}
failed=()
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records a failure
    local name=$1; shift
    echo "== $name"
    if "$@" > "$out/$name.log" 2>&1; then tail -n 5 "$out/$name.log"; else
        echo "   FAILED (exit $?), last lines:"; tail -n 30 "$out/$name.log"; failed+=("$name"); fi
}

setup() {  # the carried wheels, OptiML with CUDA (kept when already built)
    mkdir -p "$out"
    py=$(command -v python3)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    export PYTHONPATH="$PWD/python:$PWD/build/pydeps"
    step deps "$py" -m pip install --quiet --no-index --no-deps --target build/pydeps "$carry"/wheels/*.whl
    step build bash -c "cmake -S . -B build/gpu -G Ninja -DOPTIML_CUDA=ON -DOPTIML_CUDA_ARCHS=native \
        -DPython_EXECUTABLE=$py && cmake --build build/gpu -j$(nproc)"
    step import "$py" -c "import optiml, json; print(json.dumps(optiml.system_info(), indent=1))"
}

llama_build() {  # llama.cpp with CUDA, from the carried sources (kept when already built)
    [ -x build/llama-cuda/bin/llama-bench ] && [ -x build/llama-cuda/bin/llama-batched-bench ] && \
        [ -x build/llama-cuda/bin/llama-server ] && return
    step llama-build bash -c "mkdir -p build/llama-src && tar -xJf $carry/llama.cpp.tar.xz -C build/llama-src && \
        cmake -S build/llama-src -B build/llama-cuda -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF && \
        cmake --build build/llama-cuda -j$(nproc) --target llama-bench llama-batched-bench llama-server"
}

hybrid() {
    setup
    llama_build
    for act in relu silu; do
        step "hybrid-$act" "$py" tools/bench_hybrid.py --device cuda --shape 7b --activation "$act" \
            --budgets 0.25 0.5 --llama-bench build/llama-cuda/bin/llama-bench \
            --tokenizer-from "$carry/models/tokenizer-donor.gguf" --workdir build/bench-hybrid
        cat "$out/hybrid-$act.log" | tail -n 25
    done
    echo "== summary: ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}"
    [ ${#failed[@]} -eq 0 ]
}

models=build/gpu-models

make_models() {  # real ones carried in parts, synthetic ones made here (kept when already made)
    mkdir -p "$models"
    for p in "$carry"/models/*.gguf.part-aa; do
        [ -e "$p" ] || continue
        cat "${p%.part-aa}".part-* > "$models/$(basename "${p%.part-aa}")"
    done
    cp "$carry"/models/*.gguf "$models/" 2>/dev/null || true
    local donor=$models/tokenizer-donor.gguf
    for spec in "llama7b-q4_0 --type q4_0" "llama7b-q4_k --type q4_k" \
                "llama13b-q4_0 --type q4_0 --n-embd 5120 --n-layer 40 --n-ff 13824 --n-head 40 --n-head-kv 40"; do
        set -- $spec
        local name=$1; shift
        [ -e "$models/$name.gguf" ] || step "make-$name" "$py" tools/make_synthetic_model.py -o "$models/$name.gguf" \
            --tokenizer-from "$donor" --quiet "$@"
    done
}

offload() {
    setup
    make_models
    export OPTIML_MODEL_DIR="$PWD/$models"
    step offload-tests "$py" -m pytest -q tests/test_cuda.py -k offload tests/test_attention_offload.py \
        tests/test_offload_policy.py -p no:cacheprovider
    llama_build
    for share in 0.25 1; do
        step "offload-$share" "$py" tools/bench_offload.py -m "$models/llama7b-q4_0.gguf" --device cuda \
            --offered 16 --kv-share "$share" --ctx 2048 --gen 128 --llama-server build/llama-cuda/bin/llama-server
        cat "$out/offload-$share.log" | tail -n 12
    done
    echo "== summary: ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}"
    [ ${#failed[@]} -eq 0 ]
}

run() {
    setup
    make_models

    # The tests look for SmolLM2 and Gemma 3 in the model cache.
    export OPTIML_MODEL_DIR="$PWD/$models"
    step tests "$py" -m pytest -q -x tests/test_cuda.py tests/test_engine.py tests/test_attention_offload.py \
        -p no:cacheprovider
    step hw "$py" -m optiml hw --device cuda -o "$out/hw.json"
    step timeline "$py" -m optiml bench -m "$models/llama7b-q4_0.gguf" --device cuda --vram 2GiB --timeline 8 \
        --trace "$out/timeline.json"
    step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$py" -m pytest -q -x tests/test_cuda.py \
        -k "whole_model and smollm2" -p no:cacheprovider

    llama_build
    local args=()
    for m in "$models"/*.gguf; do [ "$(basename "$m")" = tokenizer-donor.gguf ] || args+=(-m "$m"); done
    step bench "$py" tools/bench_gpu.py "${args[@]}" --llama-bench build/llama-cuda/bin/llama-bench \
        --llama-batched-bench build/llama-cuda/bin/llama-batched-bench
    cat "$out/bench.log"

    echo "== summary: ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}"
    [ ${#failed[@]} -eq 0 ]
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    hybrid) hybrid ;;
    offload) offload ;;
    *) echo "usage: tools/gpu_check.sh prepare|run|hybrid|offload" >&2; exit 2 ;;
esac
