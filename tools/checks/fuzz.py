#!/usr/bin/env python3
"""Coverage-guided fuzzing campaigns over everything that reads untrusted input.

Native targets (libFuzzer, clang, with AddressSanitizer + UndefinedBehaviorSanitizer):
    gguf        tests/fuzz/fuzz_gguf.cpp: GGUF parser, metadata getters, tokenizer and model loaders
                (optiml.sparsity.*, optiml.placement.*), one forward pass of small models
    tokenizer   tests/fuzz/fuzz_tokenizer.cpp: the reference models' tokenizers on arbitrary bytes
Python targets (atheris; tests/fuzz/targets.py):
    py-template, py-convert, py-gguf, py-tokenizer

    python tools/checks/fuzz.py gguf --minutes 30        # builds build/fuzz with clang first if needed
    PYTHONPATH=python python tools/checks/fuzz.py py-template --runs 100000
    python tools/checks/fuzz.py gguf --reproduce crash-0123abcd

The Python targets fuzz the optiml package this interpreter imports: the installed one, or the source
tree with PYTHONPATH=python in a dev loop (build in place first).

Seeds are generated (tests/fuzz/seeds.py and the seed functions of targets.py) into the corpus folder
(default fuzz-corpus/TARGET, git-ignored), which grows across campaigns. A crash, a sanitizer report or
an input running over 1 s (-timeout=1) stops the campaign and leaves the input in fuzz-artifacts/;
every one found becomes a fixed bug plus a regression input under tests/fuzz/regressions/TARGET/.
Needs: clang and libFuzzer for the native targets (Debian: apt-get install clang-14 libfuzzer-14-dev),
`pip install atheris` for the Python ones (in the test extra).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/checks/ -> the checkout
NATIVE = ("gguf", "tokenizer")
PYTHON = ("py-template", "py-convert", "py-gguf", "py-tokenizer")
BUILD = os.path.join(ROOT, "build", "fuzz")


def model_cache() -> str:
    """The package's model cache; tools/fetch_models.py's loader finds it where the package is not built."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from fetch_models import models

    return str(models.cache_dir())


def reference_models() -> list[str]:
    names = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m-Q4_K_M.gguf"]
    return [os.path.join(model_cache(), n) for n in names if os.path.isfile(os.path.join(model_cache(), n))]


def find_clang() -> tuple[str, str]:
    for v in ("", "-19", "-18", "-17", "-16", "-15", "-14"):
        if shutil.which("clang++" + v):
            return "clang" + v, "clang++" + v
    raise SystemExit("no clang++ found: the native targets need clang and libFuzzer "
                     "(Debian: apt-get install clang-14 libfuzzer-14-dev)")


def build_native() -> None:
    cc, cxx = find_clang()
    if not os.path.exists(os.path.join(BUILD, "build.ninja")):
        subprocess.run(["cmake", "-S", ROOT, "-B", BUILD, "-G", "Ninja", "-DOPTIML_CUDA=OFF", "-DOPTIML_FUZZ=ON",
                        "-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DCMAKE_C_COMPILER={cc}",
                        f"-DCMAKE_CXX_COMPILER={cxx}", f"-DPython_EXECUTABLE={sys.executable}"], check=True)
    subprocess.run(["cmake", "--build", BUILD, "-j2"], check=True)


def optiml_dir() -> str:
    """The folder holding the optiml package to fuzz: the one this interpreter imports (installed, or
    the source tree on PYTHONPATH), else the source tree."""
    try:
        import optiml

        return os.path.dirname(os.path.dirname(os.path.abspath(optiml.__file__)))
    except ImportError:
        return os.path.join(ROOT, "python")


def write_seeds(target: str, corpus: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "fuzz"))
    sys.path.insert(1, optiml_dir())
    import targets

    name = {"gguf": "gguf", "tokenizer": "tokenizer"}.get(target, target.removeprefix("py-"))
    seeds = targets.TARGETS[name][1]()
    regressions = os.path.join(ROOT, "tests", "fuzz", "regressions", target)
    os.makedirs(corpus, exist_ok=True)
    for i, s in enumerate(seeds):
        with open(os.path.join(corpus, f"seed-{i:03d}"), "wb") as f:
            f.write(s)
    if os.path.isdir(regressions):
        for n in os.listdir(regressions):
            shutil.copy(os.path.join(regressions, n), os.path.join(corpus, "regression-" + n))


def libfuzzer_args(a, artifacts: str) -> list[str]:
    args = [f"-timeout={a.timeout}", "-rss_limit_mb=2048", "-print_final_stats=1", f"-artifact_prefix={artifacts}/"]
    if a.minutes is not None:
        args.append(f"-max_total_time={int(a.minutes * 60)}")
    if a.runs is not None:
        args.append(f"-runs={a.runs}")
    dictionary = os.path.join(ROOT, "tests", "fuzz", a.target.removeprefix("py-") + ".dict")
    if os.path.isfile(dictionary):
        args.append(f"-dict={dictionary}")
    return args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=NATIVE + PYTHON)
    ap.add_argument("--minutes", type=float, help="campaign length (default: 5 minutes unless --runs is given)")
    ap.add_argument("--runs", type=int, help="stop after this many inputs")
    ap.add_argument("--corpus", help="corpus folder (default fuzz-corpus/TARGET)")
    ap.add_argument("--timeout", type=int, default=1, help="seconds after which an input counts as a hang (default 1)")
    ap.add_argument("--reproduce", metavar="INPUT", help="run one input (a crash file) and exit")
    ap.add_argument("--no-build", action="store_true", help="native: use build/fuzz as it is")
    a = ap.parse_args(argv)
    if a.minutes is None and a.runs is None:
        a.minutes = 5
    corpus = a.corpus or os.path.join(ROOT, "fuzz-corpus", a.target)
    artifacts = os.path.join(ROOT, "fuzz-artifacts", a.target)
    os.makedirs(artifacts, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:allocator_may_return_null=1")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")

    if a.target in NATIVE:
        if not a.no_build:
            build_native()
        exe = os.path.join(BUILD, f"fuzz_{a.target}")
        if a.target == "tokenizer":
            models = reference_models()
            if not models:
                raise SystemExit("the tokenizer target needs the reference models: python tools/fetch_models.py "
                                 "smollm2-135m-instruct-q4_1 gemma3-270m-q4_k_m")
            env["OPTIML_FUZZ_TOKENIZERS"] = ":".join(models)
        if a.reproduce:
            return subprocess.call([exe, a.reproduce], env=env)
        write_seeds(a.target, corpus)
        return subprocess.call([exe, corpus] + libfuzzer_args(a, artifacts), env=env)

    # Python: atheris in this interpreter, the target module instrumented for coverage.
    env["PYTHONPATH"] = os.pathsep.join([optiml_dir(), os.path.join(ROOT, "tests", "fuzz"), env.get("PYTHONPATH", "")])
    runner = os.path.join(ROOT, "tests", "fuzz", "atheris_main.py")
    if a.reproduce:
        return subprocess.call([sys.executable, runner, a.target.removeprefix("py-"), a.reproduce], env=env)
    write_seeds(a.target, corpus)
    return subprocess.call([sys.executable, runner, a.target.removeprefix("py-"), corpus]
                           + libfuzzer_args(a, artifacts), env=env)


if __name__ == "__main__":
    sys.exit(main())
