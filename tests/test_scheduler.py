"""The server's scheduler (python/optiml/server/scheduler.py) with a fake runner: no model, no logits.

The fake runner keeps what each KV slot would hold as a list of tokens: it applies the scheduler's KV
operations (copy, truncate, place) and runs its steps, checking that every token lands at the next free
position of its sequence. After each step the scheduler's idea of a slot (slot.tokens) must be what the
fake holds. The driver below does what pipeline.py does around the scheduler, with a made-up output
stage: each row gives its job one token (100 + how many it has), a job ends after max_tokens.
"""

import pytest

from optiml.server.offload import StepFeatures
from optiml.server.scheduler import Job, QueueFull, Scheduler


class FakeRunner:
    def __init__(self, n_seq, host=()):
        self.n_seq = n_seq
        self.kv = {s: [] for s in range(n_seq)}
        self.where = {s: "host" if s in host else "device" for s in range(n_seq)}
        self.ops = []
        self.fail_next = None  # an exception the next KV operation raises

    def _op(self, *op):
        self.ops.append(op)
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e

    def kv_copy(self, src, dst, n):
        self._op("copy", src, dst, n)
        self.kv[dst] = self.kv[src][:n]

    def kv_truncate(self, seq, n):
        self._op("truncate", seq, n)
        del self.kv[seq][n:]

    def kv_where(self, seq):
        return self.where[seq]

    def kv_place(self, seq, where):
        self._op("place", seq, where)
        self.where[seq] = where

    def decode(self, batch):
        """The number of rows that want logits; checks each token's position."""
        for t, s, p in zip(batch.tokens, batch.seq, batch.pos):
            assert p == len(self.kv[s]), f"sequence {s}: token at {p}, the KV holds {len(self.kv[s])}"
            self.kv[s].append(t)
        return sum(batch.logits)


class Driver:
    """The pipeline's loop around the scheduler, one step per call."""

    def __init__(self, sched, runner):
        self.s, self.r = sched, runner
        self.done, self.failed, self.steps = [], [], []

    def fail(self, j, message):
        self.failed.append((j, message))
        self.s.release(j)

    def step(self):
        with self.s.cond:
            self.s.drop_cancelled()
        self.s.admit(self.fail)
        step = self.s.schedule()
        self.steps.append(step)
        if step is None:
            return None
        assert self.r.decode(step.batch) == len(step.rows)
        self.s.ran(step, 0.0)
        for j in step.active:
            assert j.slot.tokens == self.r.kv[j.slot.index]
        for j in step.rows:
            if j.cancelled:
                continue
            j.generated.append(100 + len(j.generated))
            if len(j.generated) >= j.max_tokens:
                self.done.append(j)
                self.s.release(j)
            else:
                j.next_token = j.generated[-1]
        return step

    def until_idle(self, limit=100):
        for _ in range(limit):
            if self.step() is None and not self.s.waiting:
                return
        raise AssertionError("the scheduler did not finish its jobs")


def job(index, prompt, max_tokens=3, logprobs=False):
    return Job(index, list(prompt), max_tokens, None, [], lambda ev: None, 0 if logprobs else -1)


def make(n_parallel=2, max_queue=4, chunk=256, n_seq=None, host=(), policy=None):
    r = FakeRunner(n_seq or n_parallel, host)
    s = Scheduler(r, n_parallel, max_queue, chunk, policy)
    return s, r, Driver(s, r)


def test_admission_in_order_and_the_queue_limit():
    s, r, d = make(n_parallel=2, max_queue=1)
    a, b, c = job(0, [1, 2, 3], 2), job(1, [4, 5, 6], 4), job(2, [7, 8, 9], 2)
    s.submit([a, b, c])  # two free slots and a queue of one
    with pytest.raises(QueueFull):
        s.submit([job(3, [1])])
    d.step()
    assert (a.slot.index, b.slot.index, c.slot) == (0, 1, None)
    assert s.status() == {"slots_idle": 0, "slots_processing": 2, "queue": 1}
    while c.slot is None:
        d.step()
    assert a in d.done and c.slot.index == 0  # a's slot, once a finished
    d.until_idle()
    assert d.done == [a, c, b] and all(len(j.generated) == j.max_tokens for j in d.done)
    assert s.status() == {"slots_idle": 2, "slots_processing": 0, "queue": 0}
    with pytest.raises(ValueError, match="exceeds the model's sequence slots"):
        Scheduler(FakeRunner(2), 3, 4)


def test_prompts_run_in_chunks_and_generation_is_never_starved():
    s, r, d = make(n_parallel=3, chunk=4)
    a = job(0, range(10), 5)
    s.submit([a])
    for want in ([0, 1, 2, 3], [4, 5, 6, 7]):
        step = d.step()
        assert step.prefill == [(a, want)] and step.rows == [] and step.batch.logits == [False] * 4
    step = d.step()
    assert step.prefill == [(a, [8, 9])] and step.rows == [a] and step.batch.logits == [False, True]
    b, c = job(1, range(20, 26), 2), job(2, range(30, 33), 2)
    s.submit([b, c])
    step = d.step()  # a's token first, then 4 prompt tokens, first come first served
    assert step.gen == [a] and step.prefill == [(b, [20, 21, 22, 23])]
    assert step.batch.tokens == [a.generated[0], 20, 21, 22, 23]
    step = d.step()
    assert step.gen == [a] and step.prefill == [(b, [24, 25]), (c, [30, 31])] and step.rows == [a, b]
    d.until_idle()
    assert sorted(j.index for j in d.done) == [0, 1, 2]


def test_a_new_prompt_reuses_the_longest_cached_prefix():
    s, r, d = make(n_parallel=2)
    a = job(0, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    s.submit([a])
    d.until_idle()
    assert r.kv[0] == [1, 2, 3, 4, 5, 6, 7, 8, 100]  # the prompt and the token run after it
    b = job(1, [1, 2, 3, 4, 5, 20, 21], 1)
    s.submit([b])
    step = d.step()
    assert b.slot.index == 0 and b.cached == 5 and ("truncate", 0, 5) in r.ops
    assert step.prefill == [(b, [20, 21])]
    c = job(2, [1, 2, 3, 4, 5, 20, 21], 1)  # the same prompt: its last token still runs, for its logits
    s.submit([c])
    step = d.step()
    assert c.slot.index == 0 and c.cached == 6 and step.prefill == [(c, [21])]


def test_a_busy_slots_prefix_is_copied():
    s, r, d = make(n_parallel=2)
    a = job(0, [1, 2, 3, 4, 5, 6], 20)
    s.submit([a])
    d.step()
    b = job(1, [1, 2, 3, 4, 9], 1)
    s.submit([b])
    step = d.step()
    assert b.slot.index == 1 and ("copy", 0, 1, 4) in r.ops and b.cached == 4
    assert step.prefill == [(b, [9])]


def test_jobs_reading_a_common_prefix_compute_it_once():
    s, r, d = make(n_parallel=2)
    a, b = job(0, [1, 2, 3, 4, 5, 6, 7], 3), job(1, [1, 2, 3, 4, 5, 6, 8], 3)
    s.submit([a, b])  # n = 2 choices of one prompt share all but the last token
    step = d.step()
    assert step.prefill == [(a, [1, 2, 3, 4, 5, 6, 7])]  # b waits for a's prefix
    step = d.step()
    assert ("copy", 0, 1, 6) in r.ops and step.prefill == [(b, [8])] and b.cached == 6


def test_cancelled_jobs_leave_at_the_next_step_and_keep_their_cache():
    s, r, d = make(n_parallel=1, max_queue=4)
    a, b, c = job(0, [1, 2, 3], 50), job(1, [4, 5], 50), job(2, [1, 2, 3, 9], 1)
    s.submit([a, b, c])
    d.step()
    d.step()
    s.cancel([b])  # waiting: forgotten
    s.cancel([a])  # running: its slot is free at the next step
    assert s.status() == {"slots_idle": 0, "slots_processing": 1, "queue": 2}
    step = d.step()
    assert step.active == [c] and b.slot is None
    assert c.cached == 3  # a's KV stayed as cache
    d.until_idle()
    assert d.done == [c] and a not in d.done and b not in d.done


def test_a_plain_job_alone_takes_lone_steps():
    s, r, d = make(n_parallel=2)
    a = job(0, [1, 2, 3], 6)
    s.submit([a])
    assert d.step().lone is None  # the prompt: a batched step
    assert d.step().lone is a
    b = job(1, [4, 5], 2)
    s.submit([b])
    assert d.step().lone is None  # not alone any more
    d.until_idle()
    c = job(2, [1, 2], 3, logprobs=True)  # logprobs: never the lone step
    s.submit([c])
    assert all(st.lone is None for st in [d.step(), d.step()])


def test_a_failed_kv_operation_fails_its_job_alone():
    s, r, d = make(n_parallel=1)
    r.fail_next = RuntimeError("simulated KV failure")
    a, b = job(0, [1, 2, 3], 2), job(1, [1, 2, 4], 2)
    s.submit([a, b])
    d.until_idle()
    assert [(j, "simulated" in m) for j, m in d.failed] == [(a, True)]
    assert d.done == [b] and s.slots[0].job is None


class Policy:
    """An offload policy that answers what it is told and records what it was asked."""

    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def admit_on_host(self, now, added_kv):
        self.asked.append((now, added_kv))
        return self.answer


@pytest.mark.parametrize("answer", [False, True])
def test_with_every_device_slot_busy_the_policy_decides(answer):
    p = Policy(answer)
    s, r, d = make(n_parallel=2, host=(1,), policy=p)
    a, b = job(0, [1, 2, 3], 4), job(1, [4, 5, 6, 7], 6)
    s.submit([a])
    d.step()
    d.step()
    s.submit([b])
    n = len(a.slot.tokens)
    d.step()
    assert p.asked[0] == (StepFeatures(1, n + 1, 0), 4)  # a's next token attends over n + 1 positions
    if not answer:
        assert b.slot is None  # waits for the device slot
        d.until_idle()
        assert b.slot.index == 0 and d.done == [a, b]
        return
    assert b.slot.index == 1 and r.where[1] == "host"
    assert s.step_features(d.steps[-1].batch) == StepFeatures(5, 5, 1 + 2 + 3 + 4)
    d.until_idle()
    # a finished first: its device slot went to b, its own cache to the host.
    assert ("place", 0, "host") in r.ops and ("place", 1, "device") in r.ops
    assert d.done == [a, b]
