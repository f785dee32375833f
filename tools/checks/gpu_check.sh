#!/usr/bin/env bash
# The GPU check of issues #16/#17 in one command, for a machine with a CUDA GPU and no package registry.
#
#   tools/checks/gpu_check.sh prepare   # here, with network: writes build/gpu-carry/ (under 64 MiB): the wheels the
#                                # GPU image lacks, llama.cpp's sources (from llama-cpp-python's sdist), and a
#                                # tokenizer-only GGUF for the synthetic models
#   tools/checks/gpu_check.sh prepare-llama  # here (nvcc, no GPU; long on 2 cores): llama.cpp's CUDA programs built
#                                # for sm_90 and packed into the carry, so the GPU machine does not compile them
#   tools/checks/gpu_check.sh split M.gguf  # here: a real model too big for one call in two halves,
#                                # build/gpu-parts-a and -b, to carry over two back-to-back calls
#   tools/checks/gpu_check.sh verify    # there, in one call of under 10 minutes: the GPU tests, tools/bench/gpu.py on
#                                # a 7B Q4_0 model against llama.cpp (with the kernels and bytes a decode step
#                                # launches, batch 1 and 8: --launches; and again unfused, OPTIML_CUDA_FUSE=0:
#                                # --unfused, and without the prompts' tensor-core tiles, OPTIML_CUDA_TILES=0:
#                                # --untiled, and batch-1 decode by the kernels built for batches,
#                                # OPTIML_CUDA_ONE_TOKEN=0: --batch-kernels; decode at depth 4096, with the attention split over the
#                                # positions and without: --depth), each product kernel alone
#                                # (tools/bench/gpu_kernels.py), the hybrid benchmark (ReLU, 25%) and the
#                                # mixture-of-experts one
#                                # (tools/bench/moe_gpu.py: hot experts placed by the solver against llama.cpp
#                                # -ncmoe at the same memory, a 4-layer Qwen3-30B-A3B shape); Nsight Compute's
#                                # summary of two decode steps (tools/bench/ncu_decode.py) comes right after
#                                # the whole-model benchmark, so the budget reaches it
#   tools/checks/gpu_check.sh run       # there (carry build/gpu-carry): builds OptiML with CUDA (and llama.cpp when
#                                # not carried prebuilt), runs the GPU tests (with the real models when
#                                # their parts were carried) and compute-sanitizer's memcheck, makes synthetic
#                                # 7B/13B-shaped models, then benchmarks against llama.cpp (tools/bench/gpu.py)
#   tools/checks/gpu_check.sh hybrid    # there, after run (a warm machine keeps its builds; else they are redone):
#                                # issue #17's benchmark, tools/bench/hybrid.py, for 7B-shaped ReLU (90%
#                                # sparse) and SwiGLU (50%) models with planted power-law firing at 25% and
#                                # 50% of the model in VRAM, against llama.cpp CUDA -ngl at the same memory
#   tools/checks/gpu_check.sh offload   # there (after run, or alone): issue #19's GPU test and benchmark,
#                                # tools/bench/offload.py: the 7B-shaped model served to 16 clients with device
#                                # KV memory for a quarter of them (and for all), GPU-only vs CPU attention
#                                # offload vs llama-server CUDA (built without its web UI: no network there)
#
# The verbs that run there write their logs and tables to build/gpu-check and, when $OUT is set (the device
# tool brings that folder back, at most 8 files), pack them into $OUT/gpu-check.tgz at exit, with the summary
# beside it ($OUT/summary.txt) and Nsight Compute's report when it fits. They go on past a failed step and end
# with a summary and exit status 1 if any failed. Each step runs within what is left of GPU_CHECK_BUDGET_S
# (default 540 s, under the device tool's 600 s a call) and is skipped, said so, when under 20 s are left;
# GPU_CHECK_SKIP=hybrid-relu,moe (a comma list of step names) leaves steps out.
set -uo pipefail
cd "$(dirname "$0")/../.."
carry=build/gpu-carry
started=$(date +%s)
deadline=$((started + ${GPU_CHECK_BUDGET_S:-540}))

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
    if [ -z "$src" ]; then  # the sdist itself (pip only prepares its metadata; nothing is built)
        mkdir -p "$carry/sdist"
        "$py" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation -d "$carry/sdist" \
            llama-cpp-python==0.3.36
        src=$(ls "$carry"/sdist/llama_cpp_python-*.tar.gz)
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

out=build/gpu-check
failed=()
step() {  # step NAME COMMAND...: runs it within the time left, logs to $out/NAME.log, records a failure
    local name=$1; shift
    local now left; now=$(date +%s); left=$((deadline - now))
    if [[ ",${GPU_CHECK_SKIP:-}," == *",$name,"* ]]; then echo "== $name: skipped (GPU_CHECK_SKIP)"; return; fi
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s of the budget left"; failed+=("$name(no time)"); return
    fi
    echo "== $name (at $((now - started)) s, ${left} s left)"
    if timeout --kill-after=5 $((left - 10)) "$@" > "$out/$name.log" 2>&1; then tail -n 5 "$out/$name.log"; else
        local rc=$?
        [ $rc -eq 124 ] && echo "   STOPPED at the budget's end (GPU_CHECK_BUDGET_S), last lines:" || \
            echo "   FAILED (exit $rc), last lines:"
        tail -n 30 "$out/$name.log"; failed+=("$name"); fi
}

summary() {
    echo "== summary: ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}; $(( $(date +%s) - started )) s"
    [ ${#failed[@]} -eq 0 ]
}

pack() {  # at exit: what build/gpu-check holds, back through $OUT in few files
    [ -n "${OUT:-}" ] && [ -d "$out" ] || return 0
    local rep
    for rep in "$out"/*.ncu-rep; do  # Nsight Compute's report on its own (for the GUI), when it fits
        [ -e "$rep" ] && [ "$(stat -c %s "$rep")" -lt $((15 * 1024 * 1024)) ] && mv "$rep" "$OUT/"
    done
    # (a report too large to come back alone is left out too: the archive must stay under the 16 MiB a file)
    tar -czf "$OUT/gpu-check.tgz" --exclude='*.ncu-rep' -C build gpu-check
    [ -e "$out/summary.txt" ] && cp "$out/summary.txt" "$OUT/"
    return 0
}
trap pack EXIT

setup() {  # the carried wheels, OptiML with CUDA (kept when already built)
    mkdir -p "$out"
    py=$(command -v python3)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    # The CPU's features: llama.cpp's carried CPU backend (prepare-llama) assumes AVX-512, BF16 and AMX.
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'); $(grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')" \
        | tee -a "$out/gpu.txt"
    export PYTHONPATH="$PWD/python:$PWD/build/pydeps"
    step deps "$py" -m pip install --quiet --no-index --no-deps --target build/pydeps "$carry"/wheels/*.whl
    step build bash -c "cmake -S . -B build/gpu -G Ninja -DOPTIML_CUDA=ON -DOPTIML_CUDA_ARCHS=native \
        -DPython_EXECUTABLE=$py && cmake --build build/gpu -j$(nproc)"
    step import "$py" -c "import optiml, json; print(json.dumps(optiml.system_info(), indent=1))"
}

llama_build() {  # llama.cpp with CUDA: carried prebuilt (prepare-llama), else built from the carried sources
    # A carried build finds cuBLAS in the GPU image (the CUDA toolkit's, or the one beside its PyTorch).
    local cublas
    cublas=$(find /usr/local/cuda*/lib* /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu \
        "$("$py" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)" \
        -name 'libcublas.so.13*' 2>/dev/null | head -n 1)
    [ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    [ -x build/llama-cuda/bin/llama-bench ] && [ -x build/llama-cuda/bin/llama-batched-bench ] && \
        [ -x build/llama-cuda/bin/llama-server ] && return
    if [ -e "$carry/llama-bin.tar.xz" ]; then
        step llama-unpack bash -c "mkdir -p build/llama-cuda/bin && tar -xJf $carry/llama-bin.tar.xz -C build/llama-cuda/bin && \
            build/llama-cuda/bin/llama-bench --list-devices"
        return
    fi
    step llama-build bash -c "mkdir -p build/llama-src && tar -xJf $carry/llama.cpp.tar.xz -C build/llama-src && \
        cmake -S build/llama-src -B build/llama-cuda -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF && \
        cmake --build build/llama-cuda -j$(nproc) --target llama-bench llama-batched-bench llama-server"
}

# Here (nvcc, no GPU needed): llama.cpp with CUDA for sm_90 from the sdist's sources, packed into the carry so
# that the GPU machine's time is not spent compiling it (about 40 minutes on 2 cores). Shared libraries beside
# the programs ($ORIGIN rpath). Its CPU backend is built for the GPU machine's processor (seen: a Xeon with
# AVX-512, VNNI, BF16 and AMX; LLAMA_CPU_FLAGS to change), since the hybrid comparison runs llama.cpp's CPU
# layers there: every CPU variant (GGML_CPU_ALL_VARIANTS) would take hours here. No VMM pool: it needs
# libcuda.so at link time, which a machine without a driver lacks.
prepare_llama() {
    set -e
    local src=build/llama-src
    mkdir -p "$src" && tar -xJf "$carry/llama.cpp.tar.xz" -C "$src"
    local blas=()
    cublas_args blas
    # shellcheck disable=SC2086
    cmake -S "$src" -B build/llama-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON "${blas[@]}" \
        -DCMAKE_CUDA_ARCHITECTURES=${LLAMA_CUDA_ARCHS:-90-real} -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON \
        ${LLAMA_CPU_FLAGS:--DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
        -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=ON \
        -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON} \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_RPATH='$ORIGIN'
    cmake --build build/llama-cuda -j"$(nproc)" --target llama-bench llama-batched-bench llama-server
    (cd build/llama-cuda/bin && tar -cJf "$OLDPWD/$carry/llama-bin.tar.xz" llama-bench llama-batched-bench llama-server ./*.so*)
    du -sh "$carry"
}

# cuBLAS for llama.cpp's CUDA build (it links CUDA::cublas and CUDA::cublasLt). A toolkit that is nvcc
# without cuBLAS (this project's 2-core machines) fails at "ggml-cuda links to CUDA::cublas but the target
# was not found": NVIDIA's cuBLAS wheel of the same CUDA release is unpacked under build/ and given to
# CMake. Only the build uses it; the GPU machine's programs load the GPU image's own cuBLAS (llama_build).
cublas_args() {  # cublas_args ARRAY_NAME: fills the array with CMake arguments (none when the toolkit has cuBLAS)
    local -n args=$1
    local root  # where CMake's FindCUDAToolkit looks (nvcc may be a wrapper script elsewhere)
    for root in "${CUDA_HOME:-/nonexistent}" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" /usr/local/cuda; do
        if find "$root"/lib64/ "$root"/targets/*/lib/ "$root"/lib/x86_64-linux-gnu/ -maxdepth 1 -name 'libcublas.so*' 2>/dev/null | grep -q .; then
            return 0
        fi
    done
    local py=${PYTHON:-python3} release wheel=build/cublas-wheel
    release=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
    if ! find "$wheel" -name 'libcublas.so.*' 2>/dev/null | grep -q .; then
        echo "== no cuBLAS in the CUDA toolkit: NVIDIA's cuBLAS wheel for CUDA $release"
        rm -rf "$wheel" "$wheel.dl"
        "$py" -m pip download --quiet --no-deps --only-binary=:all: -d "$wheel.dl" "nvidia-cublas==$release.*"
        "$py" -m zipfile -e "$wheel.dl"/nvidia_cublas-*.whl "$wheel"
        rm -rf "$wheel.dl"
    fi
    local lib; lib=$(dirname "$(find "$PWD/$wheel" -name 'libcublas.so.*' | head -n 1)")
    local inc; inc=$(cd "$lib/../include" && pwd)
    args=(-DCUDA_cublas_LIBRARY="$(ls "$lib"/libcublas.so.* | head -n 1)"
          -DCUDA_cublasLt_LIBRARY="$(ls "$lib"/libcublasLt.so.* | head -n 1)"
          -DCMAKE_CUDA_FLAGS="-I$inc" -DCMAKE_CXX_FLAGS="-I$inc" -DCMAKE_C_FLAGS="-I$inc")
}

hybrid() {
    setup
    llama_build
    for act in relu silu; do
        step "hybrid-$act" "$py" tools/bench/hybrid.py --device cuda --shape 7b --activation "$act" \
            --budgets 0.25 0.5 --calibrate-tokens 2048 --llama-bench build/llama-cuda/bin/llama-bench \
            --tokenizer-from "$carry/models/tokenizer-donor.gguf" --workdir build/bench-hybrid
        tail -n 40 "$out/hybrid-$act.log"
    done
    summary | tee "$out/summary.txt"
    [ ${#failed[@]} -eq 0 ]
}

models=build/gpu-models

verify() {
    setup
    export OPTIML_TOKENIZER_DONOR="$PWD/$carry/models/tokenizer-donor.gguf"
    mkdir -p "$models"
    # (the makers run beside the tests, within the budget too: a call the device tool kills returns nothing)
    timeout $((deadline - $(date +%s) - 30)) "$py" tools/make_synthetic_model.py -o "$models/llama7b-q4_0.gguf" \
        --tokenizer-from "$OPTIML_TOKENIZER_DONOR" --quiet --type q4_0 > "$out/make-llama7b-q4_0.log" 2>&1 &
    local maker=$!
    mkdir -p "$models/moe"  # issue #46's mixture of experts, 4 of Qwen3-30B-A3B's layers (1.5 GB)
    PYTHONPATH="tools/bench:$PYTHONPATH" timeout $((deadline - $(date +%s) - 30)) "$py" -c "from moe import make_model; make_model('$models/moe/qwen3moe-30b-a3b-shape-4l-q4_k.gguf', 4, 1.0, '$OPTIML_TOKENIZER_DONOR')" \
        > "$out/make-moe.log" 2>&1 &
    local moe_maker=$!
    step tests "$py" -m pytest -q -rfE --timeout 300 tests/test_cuda.py -p no:cacheprovider
    llama_build
    wait "$maker" || failed+=(make-llama7b-q4_0)
    step bench "$py" tools/bench/gpu.py -m "$models/llama7b-q4_0.gguf" --reps 2 --launches 4 --unfused --untiled --batch-kernels --depth 4096 \
        --llama-bench build/llama-cuda/bin/llama-bench --llama-batched-bench build/llama-cuda/bin/llama-batched-bench \
        --json "$out/bench.json"
    cat "$out/bench.log" 2>/dev/null
    # Next, before the steps the budget may not reach: Nsight Compute over two decode steps (each kernel's
    # time, DRAM bytes and share of the peak; the report comes back beside gpu-check.tgz for the GUI).
    step ncu timeout 180 "$py" tools/bench/ncu_decode.py -m "$models/llama7b-q4_0.gguf" --steps 2 \
        --report "$out/ncu-decode" --json "$out/ncu.json"
    cat "$out/ncu.log" 2>/dev/null
    step kernels "$py" tools/bench/gpu_kernels.py --shapes 7b --types q4_0 q4_1 q8_0 q3_k q4_k q6_k f16 --reps 10 \
        --json "$out/kernels.json"
    cat "$out/kernels.log" 2>/dev/null
    step hybrid-relu "$py" tools/bench/hybrid.py --device cuda --shape 7b --activation relu --budgets 0.25 --reps 2 \
        --tokens 32 --predictor-samples 1024 --llama-bench build/llama-cuda/bin/llama-bench --tokenizer-from "$OPTIML_TOKENIZER_DONOR" \
        --workdir build/bench-hybrid
    tail -n 40 "$out/hybrid-relu.log" 2>/dev/null
    wait "$moe_maker" || failed+=(make-moe)
    step moe "$py" tools/bench/moe_gpu.py --device cuda --n-layer 4 --share 0.25 --reps 2 --profile-tokens 1024 \
        --workdir "$models/moe" --llama-bench build/llama-cuda/bin/llama-bench --tokenizer-from "$OPTIML_TOKENIZER_DONOR"
    tail -n 12 "$out/moe.log" 2>/dev/null
    summary | tee "$out/summary.txt"
    [ ${#failed[@]} -eq 0 ]
}

make_models() {  # real ones carried in parts (join_parts), synthetic ones made here (kept when already made)
    mkdir -p "$models"
    join_parts "$models"
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
    export OPTIML_MODEL_DIR="$PWD/$models" OPTIML_TOKENIZER_DONOR="$PWD/$models/tokenizer-donor.gguf"
    step offload-tests "$py" -m pytest -q tests/test_cuda.py -k offload tests/test_attention_offload.py \
        tests/test_offload_policy.py -p no:cacheprovider
    llama_build
    for share in 0.25 1; do
        step "offload-$share" "$py" tools/bench/offload.py -m "$models/llama7b-q4_0.gguf" --device cuda \
            --offered 16 --kv-share "$share" --ctx 2048 --gen 128 --llama-server build/llama-cuda/bin/llama-server
        cat "$out/offload-$share.log" | tail -n 12
    done
    summary | tee "$out/summary.txt"
    [ ${#failed[@]} -eq 0 ]
}

run() {
    setup
    lscpu > "$out/cpu.txt" 2>&1
    # The tests first (they need only the donor; the real models when carried), then the measurements.
    local real=build/gpu-models
    mkdir -p "$real"
    join_parts "$real"
    export OPTIML_MODEL_CACHE="$PWD/$real" OPTIML_TOKENIZER_DONOR="$PWD/$carry/models/tokenizer-donor.gguf"
    step tests "$py" -m pytest -q -rfE --timeout 300 tests/test_cuda.py -p no:cacheprovider
    step hw "$py" -m optiml hw --device cuda -o "$out/hw.json"
    step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$py" -m pytest -q -x tests/test_cuda.py \
        -k "synthetic_model_matches_the_cpu or splits_match or whole_model" -p no:cacheprovider
    make_models
    step timeline "$py" -m optiml bench -m "$models/llama7b-q4_0.gguf" --device cuda --vram 2GiB --timeline 8 \
        --trace "$out/timeline.json"

    llama_build
    local args=()
    for m in "$models"/llama*.gguf; do args+=(-m "$m"); done
    [ -x build/llama-cuda/bin/llama-bench ] && args+=(--llama-bench build/llama-cuda/bin/llama-bench \
        --llama-batched-bench build/llama-cuda/bin/llama-batched-bench)
    step bench "$py" tools/bench/gpu.py "${args[@]}"
    cat "$out/bench.log" 2>/dev/null

    summary | tee "$out/summary.txt"
    [ ${#failed[@]} -eq 0 ]
}

# A real model too big for one call travels in parts over back-to-back calls (the machine keeps what earlier
# calls left): build/gpu-parts-*/NAME.gguf.part-* are joined into DIR once every part is there
# (tools/checks/gpu_check.sh split MODEL.gguf writes two halves into build/gpu-parts-a and -b).
join_parts() {
    local dir=$1 first
    for first in build/gpu-parts-a/*.gguf.part-aa; do
        [ -e "$first" ] || continue
        local name; name=$(basename "${first%.part-aa}")
        [ -e "$dir/$name" ] && continue
        local parts=(build/gpu-parts-*/"$name".part-*)
        if [ ${#parts[@]} -ge 2 ]; then cat "${parts[@]}" > "$dir/$name"; echo "== joined $name"; fi
    done
}

split_model() {
    local m=$1 name; name=$(basename "$m")
    rm -rf build/gpu-parts-a build/gpu-parts-b && mkdir -p build/gpu-parts-a build/gpu-parts-b
    split -n 2 -a 2 "$m" "build/gpu-parts-a/$name.part-"
    mv "build/gpu-parts-a/$name.part-ab" build/gpu-parts-b/
    du -sh build/gpu-parts-a build/gpu-parts-b
}

case "${1:-}" in
    prepare) prepare ;;
    prepare-llama) prepare_llama ;;
    run) run ;;
    verify) verify ;;
    split) split_model "$2" ;;
    hybrid) hybrid ;;
    offload) offload ;;
    *) echo "usage: tools/checks/gpu_check.sh prepare|prepare-llama|split|verify|run|hybrid|offload" >&2; exit 2 ;;
esac
