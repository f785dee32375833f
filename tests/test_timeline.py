"""The timeline of a step (Model.timeline, optiml bench --timeline): every op, copy and wait timed on the
device that runs it. On the second CPU device (cpu:1), a split layer's two FFN shares both run each step and are
joined after both; how much they overlap is measured (`optiml bench --timeline`), not asserted.

Oracles: the plan (which device computes what), the counts of ops a step makes, and interval arithmetic
checked by hand on made-up spans.
"""

import json
import subprocess
import sys

import pytest

import optiml
from optiml.engine.timeline import Timeline

from conftest import ROOT


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("timeline") / "tl.gguf"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_model.py"), "-o", str(path), "--quiet",
                    "--n-embd", "512", "--n-layer", "4", "--n-ff", "2048", "--n-head", "8", "--n-head-kv", "4",
                    "--type", "q4_0", "--std", "0.05"], check=True, capture_output=True)
    return path


def test_split_layers_run_both_shares_on_the_second_device(model_path):
    """Each step of a split layer runs both FFN shares' gate and up products, one on each device; the host
    then finishes the FFN with the device's products beside its own (act and the down product) and joins it.
    These are data dependencies the executor must keep, so they hold however the OS schedules the two threads.
    How long the shares actually ran at the same time depends on that scheduling: it is measured and
    printed (`optiml bench --timeline`, tools/bench/hybrid.py), never asserted here."""
    with optiml.Model(model_path, n_ctx=1024, n_threads=1, device="cpu:1", gpu_neurons=1024) as m:
        assert all(0 < layer["ffn_on_device"] < 2048 for layer in m.plan.layers)
        t = m.timeline(3, batch=256)
    assert t.devices == ("cpu", "cpu:1") and t.n_tokens == 3
    layers = [r for r in t.layers() if r.layer >= 0]
    assert [r.layer for r in layers] == [0, 1, 2, 3]
    for r in layers:
        assert r.host_ops.get("ffn", 0) > 0 and r.device_ops.get("ffn", 0) > 0, r
        assert "copy_in" in r.device_ops or "copy_out" in r.device_ops  # the FFN input or output crosses
        assert 0 <= r.overlap <= min(r.host_busy, r.device_busy) + 1e-9
    for layer in range(4):
        ffn = [s for s in t.spans if s[1] == layer and s[2] == "ffn"]
        joins = [s for s in t.spans if s[1] == layer and s[2] == "join"]
        # a step: the host's gate/up and finish, the device's gate/up, one join
        assert sorted(s[0] for s in ffn) == [0] * 6 + [1] * 3 and len(joins) == 3
        host = sorted((s for s in ffn if s[0] == 0), key=lambda s: s[3])
        device = sorted((s for s in ffn if s[0] == 1), key=lambda s: s[3])
        for step, join in enumerate(sorted(joins, key=lambda s: s[3])):
            finish = host[2 * step + 1]
            # the device's products reach the host before it finishes, and the finish comes before the join
            assert device[step][4] <= finish[3] + 1e-9 and finish[4] <= join[3] + 1e-9, (layer, step)
    tot = t.totals()
    assert tot.host_busy <= t.wall + 1e-9 and tot.device_busy <= t.wall + 1e-9
    assert "overlap:" in str(t)


def test_host_only_timeline_counts_every_op(model_path):
    with optiml.Model(model_path, n_ctx=64, n_threads=2) as m:
        before = m.generate("Hello", max_tokens=6, temperature=0)
        t = m.timeline(5)
        after = m.generate("Hello", max_tokens=6, temperature=0)
    assert before == after  # recording changes nothing, and the context is emptied after
    assert t.devices == ("cpu",)
    assert {s[0] for s in t.spans} == {0}
    for layer in range(4):
        kinds = [s[2] for s in t.spans if s[1] == layer]
        assert kinds.count("attention") == 5 and kinds.count("ffn") == 5 and kinds.count("join") == 5
    assert [s[2] for s in t.spans if s[1] == -1].count("logits") == 5
    spans = t.spans
    assert all(a[3] <= b[3] for a, b in zip(spans, spans[1:]))  # in time order
    assert all(s[3] <= s[4] for s in spans)
    assert "layer" in str(t) and "overlap" not in str(t)


def test_interval_arithmetic_on_made_up_spans():
    spans = [(0, 0, "attention", 0.0, 1.0), (0, 0, "ffn", 1.0, 3.0), (1, 0, "copy_in", 1.0, 1.5),
             (1, 0, "ffn", 1.5, 4.0), (0, 0, "wait", 3.0, 4.0), (1, 0, "copy_out", 4.0, 4.25),
             (0, 1, "ffn", 5.0, 6.0), (1, 1, "ffn", 5.5, 5.75), (1, 1, "ffn", 5.6, 5.9)]
    t = Timeline(spans, ("cpu", "cuda:0"), 1)
    l0, l1 = t.layers()
    assert l0.host_busy == 3.0 and l0.device_busy == 3.25 and l0.copies == 0.75
    assert l0.host_wait == 1.0 and l0.overlap == 2.0  # [1, 3] of the host against [1, 4.25] of the device
    assert l1.device_busy == pytest.approx(0.4) and l1.overlap == pytest.approx(0.4)  # merged [5.5, 5.9]
    assert t.wall == 6.0 and t.totals().overlap == pytest.approx(2.4)


def test_chrome_trace(model_path, tmp_path):
    with optiml.Model(model_path, n_ctx=64, n_threads=1, device="cpu:1", gpu_neurons=512) as m:
        t = m.timeline(2)
    out = tmp_path / "trace.json"
    t.to_chrome_trace(out)
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"cpu", "cpu:1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(t.spans)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["tid"] in (0, 1) for e in spans)
    assert any(e["name"] == "ffn 3" and e["tid"] == 1 for e in spans)
    with pytest.raises(ValueError, match="empty"):
        Timeline([], ("cpu",), 0).to_chrome_trace(tmp_path / "empty.json")


def test_bad_arguments_are_refused(model_path):
    with optiml.Model(model_path, n_ctx=32) as m:
        with pytest.raises(optiml.ArgumentError, match="n_tokens"):
            m.timeline(0)
        with pytest.raises(optiml.ArgumentError, match="do not fit the context"):
            m.timeline(20, batch=4)
        assert m.generate("Hi", max_tokens=2, temperature=0)  # still usable


def test_bench_timeline_command(model_path, tmp_path):
    trace = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "optiml", "bench", "-m", str(model_path), "-t", "1", "--device",
                        "cpu:1", "--gpu-neurons", "1024", "--timeline", "2", "--trace", str(trace)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "overlap:" in r.stdout and "cpu:1" in r.stdout and trace.exists()
    bad = subprocess.run([sys.executable, "-m", "optiml", "bench", "-m", str(model_path), "--device", "gpu"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "device" in bad.stderr


def test_launch_counts_on_a_device_that_counts_none(model_path):
    """Model.launches (optiml bench --launches) where the device keeps no launch counts (the CPU ones; the CUDA
    backend counts, tests/test_cuda.py): an empty table that says so, and the context emptied after."""
    with optiml.Model(model_path, n_ctx=64, n_threads=1, device="cpu:1", gpu_neurons=1024) as m:
        c = m.launches(2, prompt="Hello world")
        assert m.n_past == 0
    assert c.rows == [] and c.n_steps == 2 and c.per_token()["kernels"] == 0
    assert "counts none" in str(c)
    assert c.to_dict()["per_token"]["weight_bytes"] == 0
