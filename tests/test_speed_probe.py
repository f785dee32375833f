"""sparsity="auto" keeps the sparse FFN only where it is faster than the dense one on this machine
(optiml.engine.speed_probe). The clock is replaced by a fixed one: what is tested is the decision, its cache
and that the model then computes what it says it does, not how fast this machine is."""

import json
import os

import numpy as np
import pytest

import optiml
from optiml.engine import speed_probe

from test_engine import synthetic

IDS = list(range(200, 216))


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("probe") / "relu.gguf", "--n-embd", "128", "--n-layer", "2",
                     "--n-ff", "512", "--n-head", "4", "--n-head-kv", "4", "--type", "f32", "--activation", "relu",
                     "--std", "0.05")


@pytest.fixture
def probe_on(monkeypatch, tmp_path):
    """The probe turned on, its cache in a fresh OPTIML_HOME, and a clock that reports `times[mode]` ms a step
    for the sparsity mode the model is in when a phase runs; returns (times, the modes timed)."""
    monkeypatch.setenv("OPTIML_SPARSITY_PROBE", "on")
    monkeypatch.setenv("OPTIML_HOME", str(tmp_path / "home"))
    times = {"none": 1.0, "exact": 1.0}
    seen = []

    def phase(model, ids, steps):
        seen.append(model.sparsity)
        model.eval(ids[:2])  # the model must run in the mode it says it is in
        model.reset()
        return times[model.sparsity] / 1e3

    monkeypatch.setattr(speed_probe, "_phase", phase)
    return times, seen


def logits(m):
    out = m.eval(IDS, all_logits=True)
    m.reset()
    return out


def test_auto_keeps_sparse_that_pays(relu_model, probe_on):
    times, seen = probe_on
    times["exact"] = 0.5
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "exact"
        assert "the sparse FFN is used" in m.sparsity_note
        assert {"none", "exact"} <= set(seen)
        m.eval(IDS)
        assert m.sparsity_stats()["skipped"] > 0.2  # zeros really are skipped
    assert os.path.isfile(speed_probe.cache_path())


def test_auto_falls_back_to_dense_when_sparse_is_slower(relu_model, probe_on):
    times, seen = probe_on
    times["exact"] = 1.01  # within the margin: a tie goes to dense
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "none"
        assert "not used" in m.sparsity_note and "ms" in m.sparsity_note
        got = logits(m)
        m.eval(IDS)
        assert m.sparsity_stats()["skipped"] == 0.0
    with optiml.Model(relu_model, n_ctx=64, n_threads=2, sparsity="none") as ref:
        np.testing.assert_array_equal(got, logits(ref))  # the dense path itself, not a sparse leftover


def test_verdict_is_cached_per_machine_file_and_threads(relu_model, probe_on):
    times, seen = probe_on
    times["exact"] = 2.0
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "none"
    n = len(seen)
    times["exact"] = 0.1  # a cached verdict is not timed again: the same choice, whatever the clock says now
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "none" and len(seen) == n
    with open(speed_probe.cache_path(), encoding="utf-8") as f:
        cached = json.load(f)
    assert len(cached) == 1 and next(iter(cached.values()))["pays"] is False
    with optiml.Model(relu_model, n_ctx=64, n_threads=1) as m:  # other threads: timed anew
        assert m.sparsity == "exact" and len(seen) > n


def test_explicit_choices_are_not_timed(relu_model, probe_on):
    times, seen = probe_on
    times["exact"] = 5.0
    with optiml.Model(relu_model, n_ctx=64, n_threads=2, sparsity="threshold") as m:
        assert m.sparsity == "exact" and m.sparsity_note == ""
    with optiml.Model(relu_model, n_ctx=64, n_threads=2, sparsity="none") as m:
        assert m.sparsity == "none"
    assert seen == []


def test_probe_off_uses_the_file_as_it_is(relu_model, monkeypatch, tmp_path):
    monkeypatch.setenv("OPTIML_SPARSITY_PROBE", "off")
    monkeypatch.setenv("OPTIML_HOME", str(tmp_path))
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "exact" and m.sparsity_note == ""
    assert not os.path.exists(speed_probe.cache_path())


def test_unwritable_home_still_decides(relu_model, probe_on, monkeypatch, tmp_path):
    times, _ = probe_on
    times["exact"] = 2.0
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("OPTIML_HOME", str(blocker / "home"))
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "none"


def test_a_tiny_context_is_timed_within_it(relu_model, monkeypatch, tmp_path):
    """The real clock, a context of 4 positions: the probe's steps fit in it (no context overflow at load)."""
    monkeypatch.setenv("OPTIML_SPARSITY_PROBE", "on")
    monkeypatch.setenv("OPTIML_HOME", str(tmp_path))
    with optiml.Model(relu_model, n_ctx=4, n_threads=2) as m:
        assert m.sparsity in ("exact", "none") and "ms" in m.sparsity_note
        assert m.n_past == 0
        m.eval([5, 6, 7, 8])  # the whole context is free again


def test_rounds_that_disagree_give_dense_and_are_timed_again(relu_model, probe_on, monkeypatch):
    """A busy machine slows one phase and not the next: sparse must win nearly every round to be kept, and
    a verdict the rounds disagree on is not cached (the next load times it again)."""
    times, seen = probe_on
    clock = iter([0.5, 3.0] * 50)  # sparse's steps alternate fast and slow; dense's take 1 ms

    def phase(model, ids, steps):
        seen.append(model.sparsity)
        return (1.0 if model.sparsity == "none" else next(clock)) / 1e3

    monkeypatch.setattr(speed_probe, "_phase", phase)
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "none" and "timed again" in m.sparsity_note
    assert not os.path.exists(speed_probe.cache_path())
    n = len(seen)
    clock = iter([0.5] * 100)  # a quiet machine: sparse wins every round, and that is kept
    with optiml.Model(relu_model, n_ctx=64, n_threads=2) as m:
        assert m.sparsity == "exact" and len(seen) > n
    assert os.path.isfile(speed_probe.cache_path())
