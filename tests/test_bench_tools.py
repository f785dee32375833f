"""tools/bench's shared pieces and the argument checks the benchmarks make before any work: bad arguments
are one-line usage errors (exit 2), the libraries say so when run alone, figures print without exponents,
a child's peak memory is its own, a stream's tokens are counted whatever its pieces hold, and a sparse row
that ran dense is known as such. Nothing here times anything."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import table  # noqa: E402


# The tools import this process's optiml: the installed package (CI's fresh clone, whose python/ holds no
# built module), else the checkout's (the harness adds python/ when no optiml is importable).
def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["harness.py", "serving.py"])
def test_the_libraries_say_so_when_run(name):
    r = run_tool(name, "--help")
    assert r.returncode == 2 and "a library used by the other benchmarks: see tools/bench/run.py" in r.stderr


@pytest.mark.parametrize("tool, args, says", [
    ("vs_llamacpp.py", ["-r", "0"], "argument -r/--repeats: must be at least 1, not 0"),
    ("vs_llamacpp.py", ["-t", "0"], "argument -t/--threads: must be at least 1, not 0"),
    ("batch.py", ["--tokens", "0"], "argument --tokens: must be at least 1, not 0"),
    ("serve.py", ["-m", "smollm2", "--gen", "0"], "argument --gen: must be at least 1, not 0"),
    ("serve.py", ["-m", "smollm2", "--llama-server", "./nonexist"], "--llama-server ./nonexist: no such program"),
    ("perplexity.py", ["nosuch.gguf"], "nosuch.gguf: no such file, and not a known model name"),
    ("kv_quant.py", ["-m", "nosuch"], "nosuch: no such file, and not a known model name"),
    ("time_model.py", ["-m", "nosuch"], "nosuch: no such file, and not a known model name"),
    ("hybrid.py", ["--device", "gpu"], "--device gpu: not a device"),
    ("moe.py", ["--n-layer", "0"], "argument --n-layer: must be at least 1, not 0"),
    ("embeddings.py", ["--texts", "100000"], "the text has"),
    ("embeddings.py", ["-m", "nosuch"], "nosuch: no such file, and not a known model name"),
])
def test_bad_arguments_are_one_line_usage_errors(tool, args, says):
    r = run_tool(tool, *args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr


def test_a_cuda_device_this_machine_lacks_is_refused_up_front():
    ap = argparse.ArgumentParser(prog="t")
    count = len(harness.optiml.system_info().get("cuda_devices") or [])
    harness.check_device(ap, "cpu:1")
    with pytest.raises(SystemExit) as e:
        harness.check_device(ap, f"cuda:{count}")
    assert e.value.code == 2


def test_figures_print_in_plain_fixed_point():
    assert [table.figure(v) for v in (1176.6, 24.7234, 1.5, 0.957, 0.00312, 0.0, float("nan"))] == \
        ["1176.6", "24.72", "1.50", "0.957", "0.00312", "0.00", "-"]
    doc = {"tool": "t", "command": "c", "rows": [{"tok_s": 1176.6, "n": 3, "runs": [1.0, 2.0]}]}
    out = table.render(doc, None)
    assert "1176.6" in out and "e+" not in out and "runs" not in out


def test_a_childs_peak_memory_is_its_own():
    """A child of a process that once held 200 MiB reads its own peak (VmHWM), not the parent's (ru_maxrss
    carries the larger peak over exec: convert.py's first run reported 1139 MiB for every child)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("VmHWM is Linux's")
    big = np.ones(200 << 17)  # 200 MiB of float64, touched
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import harness; print(harness.peak_rss())"
    child = int(run_tool_code(code))
    del big
    assert child < harness.peak_rss() - (150 << 20)


def run_tool_code(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_stream_rates_count_tokens_not_pieces():
    serve = pytest.importorskip("serve")  # (needs httpx, as the server benchmarks do)
    # 4 tokens in 2 pieces (a UTF-8 character held back): 4 tokens over the span, 3 after the first piece
    e2e, gen = serve.rates(0.0, [1.0, 2.0], 4)
    assert e2e == 2.0 and gen == 3.0
    # --gen 1, or every token in one piece: no generation rate to give, and no division by zero
    assert serve.rates(0.0, [0.5], 1) == (2.0, None)
    assert serve.rates(0.0, [0.5], 2) == (4.0, None)
    assert serve.rates(0.0, [], 2) == (None, None)


def test_a_sparse_row_that_skipped_nothing_ran_dense():
    sparse = pytest.importorskip("sparse")
    assert sparse.ran_dense(0.0) and sparse.ran_dense(0.004) and sparse.ran_dense(None)
    assert not sparse.ran_dense(0.49)

    class Fell:
        sparsity, sparsity_note = "none", "the sparse FFN is not used, the dense one is faster"

    class Kept:
        sparsity, sparsity_note = "calibrated", "the sparse FFN is used"

    assert sparse.fallback_note(Fell()) == Fell.sparsity_note and sparse.fallback_note(Kept()) is None
