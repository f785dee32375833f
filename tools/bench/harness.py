"""What every benchmark in tools/bench shares: where things are, optiml's internals, timing, the llama.cpp
peer, the machine, and results as a printed table and as JSON.

A benchmark imports it as `import harness` (tools/bench/ is on sys.path whether the benchmark runs as
`python tools/bench/NAME.py` or through `python tools/bench/run.py NAME`). Importing it makes `optiml`
importable, here and in the processes the benchmark starts: an installed package, else this checkout's
python/ (the in-place build).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tools/bench/harness.py -> tools/bench -> tools -> ROOT
TEXT = ROOT / "tests" / "data" / "scandal-in-bohemia.txt"  # the shared evaluation text (Gutenberg #1661)
BUILD = ROOT / "build"  # where benchmarks keep what they generate (models, calibrated copies)

if importlib.util.find_spec("optiml") is None:
    sys.path.insert(0, str(ROOT / "python"))
    # and for the processes a benchmark starts (servers, `python -m optiml`, measuring children)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))

import optiml  # noqa: E402
from optiml.util.machine import cpu_name  # noqa: E402  (also harness.cpu_name for the tools)

# ---- optiml's internals ---------------------------------------------------------------------------------
# The benchmarks use the public API (optiml.Model, optiml.Batch, optiml.quant, optiml.gguf, optiml._core)
# where it suffices. What they need beyond it is named here, once, so that when the package's modules move
# this table is the one place to change. internal("models") is `import optiml.hub.registry`.
INTERNAL = {
    "models": "optiml.hub.registry",  # model names -> cached files (lookup, model_file, resolve, cache_dir)
    "hub": "optiml.hub.huggingface",  # Hugging Face references (parse): a model argument may be one
    "perplexity": "optiml.evaluate.perplexity",  # perplexity() (`optiml perplexity`), log_softmax, windows, KLD
    "predictor": "optiml.offline.predictors",  # training activation predictors, mask_quality
    "predictor_file": "optiml.formats.predictors",  # the predictor GGUF: write, check_predictors
    "stats": "optiml.formats.stats",  # profile statistics, model_fingerprint
    "plan": "optiml.plan",  # plan.make: a plan without loading weights
    "hardware": "optiml.offline.hardware",  # Hardware: the solver's machine description
    "solve": "optiml.offline.solve",  # make_groups, solve_groups, solve_placement: the placement MIP
    "sampling": "optiml.sampling",  # the Python sampler (Sampler, SamplingParams, find_stop)
    "quant_mix": "optiml.convert.quant_mix",  # the k-quant mixes (TYPES: name -> llama.cpp's ftype)
    "jsonout": "optiml.util.jsonout",  # JSON without NaN or Infinity (null instead): the --json files
    "coactive": "optiml.offline.coactive",  # co-activation order and run lengths (`optiml solve --order coactive`)
    "placement": "optiml.formats.placement",  # read_placement: a placed file's order
}


def internal(name: str):
    """One of optiml's internal modules by its role in INTERNAL."""
    return importlib.import_module(INTERNAL[name])


def fidelity():
    """tests/fidelity.py, the tests' oracle (llama.cpp logits, KL divergence against transformers): the one
    documented path by which a benchmark reuses test code. tests/ goes on sys.path for it and hf_gguf.py."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("fidelity")


def model_path(name: str, pull: bool = False) -> str:
    """A model argument as a file: a known name is its cached file (pulled first when pull is set),
    anything else is taken as a path."""
    models = internal("models")
    if pull:
        return models.resolve(name)
    return str(models.model_file(name)) if models.lookup(name) else name


def model_arg(ap, name: str, pull: bool = True) -> str:
    """A model argument as an existing file, checked before any work: a path is itself, a known model name
    (or a Hugging Face reference) its cached file, pulled first when pull is set. Anything else is a bad
    argument: ap.error, exit 2, one line."""
    if os.path.isfile(name):
        return name
    models = internal("models")
    hub_ref = internal("hub").parse(name) is not None
    if models.lookup(name) is None and not hub_ref:
        ap.error(f"{name}: no such file, and not a known model name ({', '.join(models.known())})")
    if not pull and not hub_ref:
        path = str(models.model_file(name))
        if not os.path.isfile(path):
            ap.error(f"{name} is not in the model cache ({path}): python tools/fetch_models.py {name}")
        return path
    try:
        return str(models.resolve(name))
    except (OSError, KeyError, optiml.OptimlError) as e:
        sys.exit(f"{name}: could not fetch it: {e}")


def at_least(low: int):
    """An argparse type: an integer of at least `low` (threads, repeats, tokens), so that 0 is refused
    up front in one line rather than failing later in a division or a median."""
    def parse_int(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {n}")
        return n

    return parse_int


positive = at_least(1)


def check_device(ap, device: str) -> None:
    """ap.error (exit 2) when `device` names a CUDA device this machine does not have: said before any
    model is written or any tool runs, not as a child's failure minutes later. cpu and cpu:N always exist."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or index and not index.isdigit():
        ap.error(f"--device {device}: not a device (cuda, cuda:N, or cpu:N to run without a GPU)")
    if kind == "cpu":
        return
    info = optiml.system_info()
    if int(index or 0) >= len(info.get("cuda_devices") or []):
        why = info.get("cuda_note") or ("this optiml was built without CUDA" if not info.get("cuda_compiled")
                                        else "none found")
        ap.error(f"--device {device}: no such CUDA device here ({why}); --device cpu:1 runs the pipeline without a GPU")


def existing_models(names: list[str]) -> list[str]:
    """model_path of each name, exiting with a hint when one is not there."""
    paths = []
    for name in names:
        p = model_path(name)
        if not os.path.exists(p):
            sys.exit(f"{p}: no such file (for a known model: python tools/fetch_models.py {name})")
        paths.append(p)
    return paths


# ---- timing ---------------------------------------------------------------------------------------------
median = statistics.median


def spread(runs: list[float], spec: str = ".1f") -> str:
    """median (min-max) of timed runs: the range shows how noisy the machine was."""
    return f"{format(median(runs), spec)} ({format(min(runs), spec)}-{format(max(runs), spec)})"


def noisy(*runs: list[float]) -> bool:
    """Runs of one engine that differ by more than 1.5x: the machine was busy (llama.cpp's spinning thread
    pool collapses when another process takes a core, which inflates OptiML's ratio)."""
    return any(max(r) > 1.5 * min(r) for r in runs)


def per_call(fn, n_calls: int = 1, repeats: int = 5, pick=median) -> float:
    """Seconds of one call fn(i), from passes of n_calls calls (i = 0..n_calls-1) after one warm-up pass
    (pool threads, page faults): pick (median, or min) of `repeats` passes. Kernel benchmarks cycle i
    through copies of their data so that none stays cached; min where slow passes on a shared machine
    measure other people's work."""
    for i in range(n_calls):
        fn(i)
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n_calls):
            fn(i)
        passes.append((time.perf_counter() - t0) / n_calls)
    return pick(passes)


def copies_of(a, span_mib: int) -> list:
    """a and enough copies of it to fill span_mib MiB: a kernel cycling through them reads from memory,
    not from a cache that still holds the last call's weights."""
    n = max(1, -(-(span_mib << 20) // a.nbytes))
    return [a] + [a.copy() for _ in range(n - 1)]


def time_pp(engine, prompt: list[int]) -> float:
    """llama-bench's ppN in tokens/s: the prompt as one batch from an empty context. Works on anything
    with reset() and eval(ids): optiml.Model and llama_cpp.Llama."""
    engine.reset()
    t0 = time.perf_counter()
    engine.eval(prompt)
    return len(prompt) / (time.perf_counter() - t0)


def time_tg(engine, token: int, n: int) -> float:
    """llama-bench's tgN in tokens/s: n single-token steps from an empty context."""
    return time_tg_at_depth(engine, [], token, n)


def time_tg_at_depth(engine, context: list[int], token: int, n: int) -> float:
    """llama-bench's tgN @ dD in tokens/s: n single-token steps after a context of D tokens (evaluated as one
    batch first, not timed): decoding as a long conversation does, where attention reads the whole cache."""
    engine.reset()
    if context:
        engine.eval(context)
    t0 = time.perf_counter()
    for _ in range(n):
        engine.eval([token])
    return n / (time.perf_counter() - t0)


def time_tg_text(engine, ids: list[int], n_prompt: int, n_gen: int) -> float:
    """tgN on real text, in tokens/s: after a prompt of n_prompt text tokens, n_gen further text tokens fed
    one at a time (teacher forcing: both engines do the same work and see realistic activations)."""
    engine.reset()
    engine.eval(ids[:n_prompt])
    t0 = time.perf_counter()
    for i in range(n_prompt, n_prompt + n_gen):
        engine.eval(ids[i : i + 1])
    return n_gen / (time.perf_counter() - t0)


def alternate(engines: dict, tests: dict, repeats: int, warmup: bool = True) -> dict:
    """Runs every test on every engine `repeats` times, engines alternating (and which goes first, round by
    round) so that drift on a shared machine hits all alike. tests: name -> fn(engine) -> a figure.
    Returns {(test, engine): [figures]}. The warm-up run of each pair pays page faults, thread start-up and
    first-call allocations (llama.cpp's first run of SmolLM2 was 30x slower than the rest)."""
    if warmup:
        for run in tests.values():
            for e in engines.values():
                run(e)
    out = {(t, k): [] for t in tests for k in engines}
    for rep in range(repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for t, run in tests.items():
            for k in order:
                out[(t, k)].append(run(engines[k]))
    return out


def computed_share(m, ids: list[int], n_prompt: int, n: int = 8) -> float:
    """The share of gate/up rows an OptiML model computed per generated token over n text tokens after a
    prompt of n_prompt (single-token steps only: a batch computes the union of its tokens' predicted rows)."""
    m.reset()
    m.eval(ids[:n_prompt])
    m.sparsity_stats(reset=True)
    for i in range(n_prompt, n_prompt + n):
        m.eval(ids[i:i + 1])
    return 1.0 - m.sparsity_stats()["skipped"]


def alternate_tg_text(a, b, ids: list[int], n_prompt: int, n_gen: int, repeats: int) -> tuple[list, list]:
    """time_tg_text of two engines (OptiML and llama.cpp, or two OptiML settings), alternated: (a's runs,
    b's runs)."""
    runs = alternate({"a": a, "b": b}, {"tg": lambda e: time_tg_text(e, ids, n_prompt, n_gen)}, repeats)
    return runs[("tg", "a")], runs[("tg", "b")]


def log(msg: str) -> None:
    """Progress on stderr with the time, so that stdout holds only results."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def synthetic_model(path: str, *args: str) -> str:
    """path, written first by tools/make_synthetic_model.py (with args) when missing: the 7B-shaped models
    with random weights that speed benchmarks use (about 2 minutes and 3.6 GiB each)."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        log(f"writing {path}")
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_model.py"), "-o", path, *args,
                            "--quiet"])
        if r.returncode != 0:  # its error is on the terminal already: one line more, no traceback
            sys.exit(f"writing {path} failed (exit {r.returncode}): tools/make_synthetic_model.py's error is above")
    return path


def synthetic_7b(model_dir: str, activation: str) -> str:
    """The 7B-shaped Q4_0 llama with random weights and the given FFN activation (relu, silu) in model_dir,
    the file the sparse-FFN and predictor benchmarks share."""
    return synthetic_model(os.path.join(model_dir, f"llama7b-{activation}-q4_0.gguf"), "--activation", activation)


# ---- the llama.cpp peer ---------------------------------------------------------------------------------
_llama_cpp = None


def llama_cpp(required: bool = True, instead: str | None = None):
    """The llama_cpp module (llama-cpp-python, the CPU peer), imported once; None when it is not installed
    and not required, else exit with how to install it (and `instead`, the benchmark's way to run without
    it, when it has one). Every benchmark that runs the peer checks through here, before any work."""
    global _llama_cpp
    if _llama_cpp is None:
        try:
            import llama_cpp as mod
        except ImportError:
            if required:
                sys.exit('llama-cpp-python is not installed: pip install ".[bench]" (builds llama.cpp, ~5 minutes)'
                         + (f"; or {instead}" if instead else ""))
            return None
        _llama_cpp = mod
    return _llama_cpp


def load_peer(path: str, n_ctx: int, threads: int, n_batch: int = 512, all_logits: bool = False):
    """llama.cpp on the same file with the same threads for prompts and steps."""
    return llama_cpp().Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=n_batch,
                             logits_all=all_logits, verbose=False)


def close(engine) -> None:
    """Frees an engine now rather than at garbage collection (two big models never coexist)."""
    c = getattr(engine, "close", None)
    if c:
        c()


# ---- the machine ----------------------------------------------------------------------------------------
def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """This process's peak resident bytes: VmHWM from /proc/self/status, which starts afresh at exec, where
    getrusage's ru_maxrss keeps the parent's peak when that was larger (a child started by a benchmark that
    had loaded a big model reported the parent's figure); ru_maxrss where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine() -> dict:
    """What a figure depends on: the CPU, its cores, the kernels' SIMD level, memory, the load then."""
    info = optiml.system_info()
    peer = llama_cpp(required=False)
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "simd": info.get("simd"), "memory_gib": memory_gib(),
            "load_average": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "optiml": getattr(optiml, "__version__", None),
            "llama_cpp_python": getattr(peer, "__version__", None) if peer else None}


def machine_line() -> str:
    m = machine()
    peer = f", llama-cpp-python {m['llama_cpp_python']}" if m["llama_cpp_python"] else ""
    return (f"cpu: {m['cpu']}, {m['cores']} cores, optiml simd: {m['simd']}, memory {m['memory_gib']} GiB, "
            f"load average {m['load_average']:.1f}{peer}")


def kernel_context(simd: str, threads: list[int], **about) -> tuple[str, dict]:
    """What a kernel benchmark reports before its table: (the SIMD level it runs, `simd` or the best this
    machine has; read_bandwidth(threads)), printed as comment lines with `about` (name=value)."""
    info = optiml.system_info()
    simd = simd or info["simd"]
    extra = "".join(f" {k}={v}" for k, v in about.items())
    print(f"# simd={simd} physical_cores={info['physical_cores']}{extra}")
    return simd, read_bandwidth(threads)


def read_bandwidth(threads: list[int], passes: int = 5) -> dict:
    """This machine's read bandwidth in bytes/s by thread count (1 GiB read `passes` times), the ceiling a
    memory-bound kernel is measured against; each figure printed as a comment line."""
    out = {}
    for n in threads:
        out[n] = optiml._core.measure_read_bandwidth(1 << 30, passes, n)
        print(f"# memory read bandwidth, {n} thread(s): {out[n] / 1e9:.1f} GB/s", flush=True)
    return out


def commit() -> str | None:
    """This checkout's commit, with -dirty when files differ from it (a figure names the code it timed)."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


# ---- results --------------------------------------------------------------------------------------------
def add_json_arg(ap) -> None:
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON (the schema: docs/benchmarks.md)")


def parse(ap, tool: str, argv=None):
    """(arguments, Results(tool)) from a benchmark's parser, with --json added."""
    add_json_arg(ap)
    return ap.parse_args(argv), Results(tool)


class Results:
    """A benchmark's rows, printed as a markdown table and written as JSON with one schema:
    {"tool", "command", "commit", "date", "machine", "rows": [{column: value}], "notes": [...]}.
    docs/results/ keeps runs worth keeping; tools/bench/table.py prints them back as tables."""

    def __init__(self, tool: str):
        self.tool = tool
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)

    def table(self, rows: list[dict] | None = None, formats: dict | None = None) -> str:
        """Markdown table of rows (default: all) over the union of their columns; formats: column -> a format
        spec or a function of the value (for the figures, ints and floats)."""
        rows = self.rows if rows is None else rows
        cols = list(dict.fromkeys(k for r in rows for k in r))
        formats = formats or {}

        def cell(r, c):
            v = r.get(c)
            if v is None:
                return "-"
            f = formats.get(c)
            if f is None or not isinstance(v, (int, float)) or isinstance(v, bool):
                return str(v)
            return f(v) if callable(f) else format(v, f)

        cells = [[cell(r, c) for c in cols] for r in rows]
        width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, width)) + " |",
                 "|" + "|".join("-" * (w + 2) for w in width) + "|"]
        numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                       for r in rows if r.get(c) is not None) for c in cols]  # figures right, words left
        lines += ["| " + " | ".join(x.rjust(w) if num else x.ljust(w) for x, w, num in zip(r, width, numeric)) + " |"
                  for r in cells]
        return "\n".join(lines)

    def document(self) -> dict:
        return {"tool": self.tool, "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                "commit": commit(), "date": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine(),
                "rows": self.rows, "notes": self.notes}

    def write(self, path: str | None) -> None:
        """Writes the JSON document when path is set (the --json argument)."""
        if path:
            with open(path, "w", encoding="utf-8") as f:
                internal("jsonout").dump(self.document(), f, indent=1, default=float)  # NaN, inf: null
                f.write("\n")
            print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    print("tools/bench/harness.py: a library used by the other benchmarks: see tools/bench/run.py", file=sys.stderr)
    sys.exit(2)
