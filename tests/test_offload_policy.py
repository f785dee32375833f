"""The server's CPU attention offload policy (issue #19): its cost model and decisions on synthetic costs,
and the scheduler running sequences whose KV cache does not fit the device (on cpu:1).

Oracles: costs generated from known linear formulas (the fit must recover them and the decisions must be
the ones those formulas imply), and Model.generate alone for the greedy text of each served job.
"""

import numpy as np
import pytest

import optiml
from optiml.sampling import Sampler, SamplingParams
from optiml.server.offload import MIN_FIT, CostModel, OffloadPolicy, StepFeatures
from optiml.server.pipeline import Pipeline
from optiml.server.scheduler import Job
from test_scheduler_lone import Result


def gpu_cost(f):  # seconds: 2 ms a step, 0.1 ms a token, 1 us per device KV position
    return 0.002 + 1e-4 * f.tokens + 1e-6 * f.kv_device


def calibrated(host_us_per_position, max_itl_s=None):
    """A policy whose cost model measured 40 steps of each kind from the formulas: the pipelined step
    costs what the GPU-only one does plus host_us_per_position for each host KV position."""
    p = OffloadPolicy(max_itl_s)
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 16))
        f = StepFeatures(n, int(rng.integers(0, 4000)), 0)
        p.cost.observe(f, gpu_cost(f))
        g = StepFeatures(n, int(rng.integers(0, 4000)), int(rng.integers(1, 4000)))
        p.cost.observe(g, gpu_cost(g) + host_us_per_position * 1e-6 * g.kv_host)
    return p


def test_the_cost_model_recovers_linear_costs():
    p = calibrated(2.0)
    for f in (StepFeatures(4, 1000, 0), StepFeatures(9, 300, 0), StepFeatures(5, 100, 700)):
        want = gpu_cost(f) + 2e-6 * f.kv_host
        assert p.cost.predict(f) == pytest.approx(want, rel=1e-6)


def test_the_cost_model_waits_for_enough_steps():
    c = CostModel()
    for _ in range(MIN_FIT - 1):
        c.observe(StepFeatures(2, 10, 0), 0.01)
    assert c.predict(StepFeatures(2, 10, 0)) is None
    c.observe(StepFeatures(2, 10, 0), 0.01)
    assert c.predict(StepFeatures(2, 10, 0)) == pytest.approx(0.01)
    assert c.predict(StepFeatures(2, 10, 5)) is None  # no pipelined step measured yet


def test_cheap_cpu_attention_admits_on_the_host():
    # 8 running sequences of 500 positions: 6.8 ms for 8 tokens. One more on the host at 0.1 us a position
    # adds 0.05 ms (and 0.1 ms for its token): 9 tokens in 6.95 ms is more tokens per second.
    p = calibrated(0.1)
    assert p.admit_on_host(StepFeatures(8, 4000, 0), 500)
    assert p.last[0] == "host"


def test_slow_cpu_attention_keeps_the_sequence_waiting():
    # At 20 us a position the host sequence adds 10 ms to every step: 9 tokens in 16.9 ms is fewer tokens
    # per second than 8 in 6.8 ms.
    p = calibrated(20.0)
    assert not p.admit_on_host(StepFeatures(8, 4000, 0), 500)
    assert p.last[0] == "wait: no throughput gain"


def test_the_latency_bound_is_kept():
    p = calibrated(0.1, max_itl_s=0.0069)  # admitting would take the step from 6.8 ms to 6.95 ms
    assert not p.admit_on_host(StepFeatures(8, 4000, 0), 500)
    assert p.last[0] == "wait: latency bound"
    p = calibrated(0.1, max_itl_s=0.0070)
    assert p.admit_on_host(StepFeatures(8, 4000, 0), 500)


def test_an_uncalibrated_policy_explores_unless_the_bound_was_seen_broken():
    p = OffloadPolicy(max_itl_s=0.01)
    assert p.admit_on_host(StepFeatures(2, 100, 0), 50)
    assert p.last[0] == "explore"
    p.cost.observe(StepFeatures(3, 100, 50), 0.05)  # one pipelined step over the bound
    assert not p.admit_on_host(StepFeatures(2, 100, 0), 50)


def test_with_nothing_running_a_job_starts_on_the_host_whatever_the_bound():
    # No device slot at all (or none will free up): waiting would be forever.
    p = OffloadPolicy(max_itl_s=0.01)
    p.cost.observe(StepFeatures(3, 100, 50), 0.05)  # pipelined steps broke the bound
    assert p.admit_on_host(StepFeatures(0, 0, 0), 500)
    assert p.last[0] == "host: idle"


# ---- the scheduler with one device KV slot for three ---------------------------------------------------
PROMPTS = ["The history of the printing press begins in the fifteenth century, when",
           "Write a short poem about the sea:", "The three primary colours are"]


def test_jobs_beyond_the_device_kv_run_on_the_host_with_the_same_text(smollm2_path):
    """A device KV budget of one sequence for three slots: the first job takes the device slot, the other
    two start on the host (the uncalibrated policy explores), the pipelined steps are measured, and when
    the short first job ends its device slot goes to a host job. Every job's text is what Model.generate
    gives alone."""
    lengths = [6, 24, 16]
    with optiml.Model(smollm2_path, n_ctx=128) as ref:
        want = [ref.generate(p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS, lengths)]
    with optiml.Model(smollm2_path, n_ctx=128, n_seq=3, n_threads=2, device="cpu:1", vram="2GiB",
                      kv_vram="4MiB") as m:
        assert m.plan.n_seq_device == 1
        moves = []
        place = m.kv_place

        def counted(seq, where):
            moves.append((seq, where))
            place(seq, where)

        m.kv_place = counted
        sched = Pipeline(m, 3, 8, chunk=64, policy=OffloadPolicy())
        results = [Result() for _ in PROMPTS]
        jobs = []
        for k, (p, n) in enumerate(zip(PROMPTS, lengths)):
            sampler = Sampler(m.n_vocab, SamplingParams(temperature=0))
            jobs.append(Job(k, m.tokenize(p), n, sampler, [], results[k].sink))
        sched.submit(jobs)  # before start: all three are admitted in the same round
        sched.start()
        try:
            for r in results:
                assert r.finished.wait(300), "a job did not finish"
        finally:
            sched.stop()
    assert [r.error for r in results] == [None] * 3
    assert ["".join(r.pieces) for r in results] == want
    assert len(sched.policy.cost.steps[True]) > 0, "no pipelined step ran"
    assert any(where == "device" for _, where in moves), "no host job got the freed device slot"
