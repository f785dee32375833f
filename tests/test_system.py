"""system_info(), thread settings and the persistent thread pool."""

import os
import subprocess
import sys

import pytest

import optiml
from optiml import _core


def test_system_info_reports_simd_threads_and_cuda():
    info = optiml.system_info()
    assert info["simd"] in info["simd_available"]
    assert "scalar" in info["simd_available"]
    assert info["n_threads"] >= 1
    assert info["physical_cores"] >= 1
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["cuda_devices"], list)
    for dev in info["cuda_devices"]:
        assert dev["total_memory"] > 0 and len(dev["compute_capability"]) == 2
    if not info["cuda_devices"]:
        # With no GPU (or no driver) the module still imports and says why there is no device.
        assert info["cuda_note"]


def test_cuda_note_says_why_the_build_has_no_cuda():
    """The note follows the build's OPTIML_CUDA setting (recorded in the module as cuda_build): a build
    with CUDA turned off on purpose says so, and does not blame a missing nvcc (issue #47)."""
    info = optiml.system_info()
    build = info["cuda_build"]
    assert build in ("AUTO", "ON", "OFF", "EMU")
    if build == "OFF":
        assert not info["cuda_compiled"] and not info["cuda_devices"]
        assert "OPTIML_CUDA=OFF" in info["cuda_note"] and "nvcc was not found" not in info["cuda_note"]
    elif build == "AUTO" and not info["cuda_compiled"]:
        assert "nvcc was not found" in info["cuda_note"] and "OPTIML_CUDA=OFF" not in info["cuda_note"]
    elif build in ("ON", "EMU"):
        assert info["cuda_compiled"]  # ON without nvcc fails at configure time
        if not info["cuda_devices"]:
            assert "this build has no CUDA backend" not in info["cuda_note"]


def test_simd_level_matches_cpu_features():
    info = optiml.system_info()
    feats = info["cpu_features"]
    if "avx512" in info["simd_available"]:
        assert feats["avx512f"] and feats["avx512vnni"] and feats["avx512bf16"]
    if "avx2" in info["simd_available"]:
        assert feats["avx2"] and feats["fma"] and feats["f16c"]


def test_set_num_threads_round_trip():
    before = optiml.get_num_threads()
    try:
        optiml.set_num_threads(3)
        assert optiml.get_num_threads() == 3
        assert optiml.system_info()["n_threads"] == 3
        optiml.set_num_threads(0)
        assert optiml.get_num_threads() == optiml.system_info()["physical_cores"]
    finally:
        optiml.set_num_threads(before)


def test_negative_thread_count_is_rejected():
    with pytest.raises(optiml.ArgumentError, match="threads"):
        optiml.set_num_threads(-2)
    # ArgumentError is also a ValueError and an OptimlError.
    with pytest.raises(ValueError):
        optiml.set_num_threads(-1)
    assert issubclass(optiml.ArgumentError, optiml.OptimlError)
    assert issubclass(optiml.GGUFError, optiml.OptimlError)
    # a mistyped count is refused, not run until the process has no threads left
    with pytest.raises(optiml.ArgumentError, match="at most 512"):
        optiml.set_num_threads(10**6)
    with pytest.raises(optiml.ArgumentError, match="threads"):
        optiml.set_num_threads(2**40)


def test_too_many_threads_from_the_environment_are_capped():
    r = subprocess.run([sys.executable, "-c", "import optiml; print(optiml.get_num_threads())"], capture_output=True,
                       text=True, env=dict(os.environ, OPTIML_NUM_THREADS="100000"), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "512", r.stderr
    assert "more than 512 threads: 512 are used" in r.stderr


@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_thread_pool_runs_every_share_once(n_threads):
    # Shares go to whichever thread claims them first (some shares are made slow): each still runs
    # exactly once per job, with the pool's size as nth, and run() returns only after all of them.
    r = _core._threadpool_selftest(n_threads, 1000)
    assert r["runs_per_share"] == [1000] * n_threads
    assert r["bad_nth"] == 0
    assert r["short_jobs"] == 0
    if 1 < n_threads <= 3:
        # After an idle pause the workers sleep; a job does not wait for them to wake up (it takes tens
        # of microseconds): the caller claims their shares. A pool with fixed shares never does this.
        # (8 threads on this 2-core machine: the workers may still be spinning after the pause.)
        assert r["caller_ran_all"] >= 1
    assert r["exception_propagated"]
    assert r["shares_after_exception"] == n_threads


def test_measured_bandwidth_is_plausible():
    bw = _core.measure_read_bandwidth(64 << 20, 2, 1)
    assert 1e8 < bw < 1e13


@pytest.mark.parametrize("fraction", [0.05, 0.5, 1.0])
def test_scattered_read_bandwidth_is_plausible(fraction):
    # 2304 bytes: a Q4_0 row of 4096 values (a 7B FFN's gate and up rows); 2 threads share the list.
    bw = _core.measure_scattered_read_bandwidth(2304, fraction, 16 << 20, 2, 2)
    assert 1e8 < bw < 1e13


@pytest.mark.parametrize("args, message", [
    ((100, 0.5), "multiple of 64"),
    ((2304, 0.0), r"fraction must be in \(0, 1\]"),
    ((2304, 1.5), r"fraction must be in \(0, 1\]"),
    ((2304, float("nan")), r"fraction must be in \(0, 1\]"),
    ((2304, 0.5, 4096), "fewer than 64 rows"),
    ((2304, 0.5, 16 << 20, 0), "repeats must be >= 1"),
])
def test_scattered_read_bandwidth_rejects_bad_arguments(args, message):
    with pytest.raises(optiml.OptimlError, match=message):
        _core.measure_scattered_read_bandwidth(*args)
