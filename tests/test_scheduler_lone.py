"""The pipeline's lone path: a plain job running alone takes each token in one native call
(Model._step_sequence: decode and output stage) instead of a batched step.

Oracles: the same job through the batched path (asking for logprobs keeps a job off the lone path; the
text must not change), and optiml.Model.generate run alone for greedy text.
"""

import threading

import pytest

import optiml
from optiml.engine.generation import output_stage
from optiml.sampling import Sampler, SamplingParams
from optiml.server.pipeline import Pipeline
from optiml.server.scheduler import Job

N_CTX = 256
PROMPT = "The history of the printing press begins in the fifteenth century, when"


@pytest.fixture(scope="module")
def model(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=N_CTX, n_seq=2) as m:
        yield m


@pytest.fixture(scope="module")
def ref(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=N_CTX) as m:
        yield m


@pytest.fixture()
def sched(model):
    s = Pipeline(model, 2, 4, chunk=16)
    s.lone_steps = 0
    lone = s._lone_step

    def counted(j):
        s.lone_steps += 1
        return lone(j)

    s._lone_step = counted
    s.start()
    yield s
    s.stop()


class Result:
    """Collects one job's events."""

    def __init__(self):
        self.pieces, self.done, self.error = [], None, None
        self.finished = threading.Event()
        self.deltas = 0
        self.started = threading.Event()

    def sink(self, ev):
        if ev["type"] == "delta":
            self.pieces.append(ev["text"])
            self.deltas += 1
            if self.deltas >= 5:
                self.started.set()
        elif ev["type"] == "done":
            self.done = ev
            self.finished.set()
        else:
            self.error = ev["message"]
            self.finished.set()

    @property
    def text(self):
        return "".join(self.pieces)


def job(model, prompt, sink, max_tokens=40, stops=(), bias=None, logprobs=False, **params):
    ids = model.tokenize(prompt) if isinstance(prompt, str) else prompt
    params.setdefault("temperature", 0)
    sampler = Sampler(model.n_vocab, SamplingParams(**params))
    return Job(0, ids, max_tokens, sampler, list(stops), sink, 0 if logprobs else -1, bias)


def run(sched, model, prompt, **kw):
    r = Result()
    sched.submit([job(model, prompt, r.sink, **kw)])
    assert r.finished.wait(120), "the job did not finish"
    assert r.error is None, r.error
    return r


@pytest.mark.parametrize("case", [
    dict(),
    dict(max_tokens=7),
    dict(temperature=0.9, top_k=30, seed=1234, repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    dict(stops=["printing", "\n"]),
], ids=["greedy", "max_tokens", "sampled_with_penalties", "stops"])
def test_lone_path_gives_the_python_paths_text(sched, model, case):
    before = sched.lone_steps
    native = run(sched, model, PROMPT, **case)
    if native.done["completion_tokens"] > 1:  # the first token is always sampled in a batched step
        assert sched.lone_steps > before, "the plain job did not take the lone path"
    before = sched.lone_steps
    python = run(sched, model, PROMPT, logprobs=True, **case)
    assert sched.lone_steps == before, "a job with logprobs took the lone path"
    assert native.text == python.text
    for k in ("finish_reason", "completion_tokens", "prompt_tokens"):
        assert native.done[k] == python.done[k], k


def test_lone_path_applies_logit_bias(sched, model):
    plain = run(sched, model, PROMPT, max_tokens=12)
    ids = model.tokenize(plain.text, add_bos=False)
    bias = {ids[0]: -100.0, ids[1]: 5.0}
    native = run(sched, model, PROMPT, max_tokens=12, bias=bias)
    python = run(sched, model, PROMPT, max_tokens=12, bias=bias, logprobs=True)
    assert native.text == python.text
    assert native.text != plain.text


def test_lone_stream_that_stops_at_a_stop_string(sched, model, ref):
    greedy = ref.generate(PROMPT, max_tokens=40, temperature=0)
    word = greedy.split()[len(greedy.split()) // 2]
    r = run(sched, model, PROMPT, stops=[word])
    assert r.done["finish_reason"] == "stop"
    assert r.text == greedy[: greedy.index(word)]


def test_a_second_job_joins_a_lone_one_mid_generation(sched, model, ref):
    """Job A runs alone (native steps) until it has sent 5 pieces; job B then arrives and both continue in
    batched steps. Each gets exactly the text it gets alone."""
    other = "Write a short poem about the sea:"
    want_a = ref.generate(PROMPT, max_tokens=48, temperature=0)
    want_b = ref.generate(other, max_tokens=24, temperature=0)
    a, b = Result(), Result()
    before = sched.lone_steps
    sched.submit([job(model, PROMPT, a.sink, max_tokens=48)])
    assert a.started.wait(120)
    assert sched.lone_steps > before
    sched.submit([job(model, other, b.sink, max_tokens=24)])
    assert a.finished.wait(120) and b.finished.wait(120)
    assert a.error is None and b.error is None
    assert a.text == want_a
    assert b.text == want_b


def test_step_sequence_rejects_bad_input(model):
    """The native step checks what the scheduler hands it (the API checks requests before that)."""
    import numpy as np

    from optiml import _core

    ok = Sampler(model.n_vocab, SamplingParams(temperature=0))
    tk = model.tokenizer
    with pytest.raises(optiml.ArgumentError, match="logit bias token"):
        output_stage(tk, ok, [], {model.n_vocab + 5: 1.0})
    with pytest.raises(optiml.ArgumentError, match="the sampler is for 100 tokens"):
        model._step_sequence(1, 0, 1, output_stage(tk, Sampler(100, SamplingParams(temperature=0)), []), None, False)
    with pytest.raises(optiml.ArgumentError, match="same length"):
        _core.OutputStage(tk._t, ok._s, [], np.zeros(0, np.int32), np.array([1.0], np.float32), -1)
    with pytest.raises(optiml.ArgumentError, match="allowed-token mask"):
        model._step_sequence(1, 0, 1, output_stage(tk, ok, []), np.ones(3, np.uint8), False)
    model.kv_clear(1)
    tok, end, out, lp = model._step_sequence(1, 0, model.tokenize("Hello")[0], output_stage(tk, ok, []), None, True)
    assert 0 <= tok < model.n_vocab and end == "length" and lp is None


def test_a_job_whose_admission_fails_fails_alone(sched, model, ref, monkeypatch):
    """A KV operation that raises while a job is admitted fails that job with a message; the scheduler
    thread lives on, and the next job gets its text."""
    real = model.kv_truncate
    calls = {"n": 0}

    def broken_once(seq, n):
        calls["n"] += 1
        if calls["n"] == 1:
            raise optiml.OptimlError("simulated KV failure")
        return real(seq, n)

    monkeypatch.setattr(model, "kv_truncate", broken_once)
    r = Result()
    sched.submit([job(model, PROMPT, r.sink, max_tokens=8)])
    assert r.finished.wait(120)
    assert r.error is not None and "simulated KV failure" in r.error
    assert sched.thread.is_alive()
    monkeypatch.setattr(model, "kv_truncate", real)
    assert run(sched, model, PROMPT, max_tokens=12).text == ref.generate(PROMPT, max_tokens=12, temperature=0)
    assert sched.status() == {"slots_idle": 2, "slots_processing": 0, "queue": 0}
