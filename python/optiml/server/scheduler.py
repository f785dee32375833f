"""The scheduler: what runs next. It decides and never computes: no model, no logits, no text.

Each choice of a request is a Job with its own KV slot. A step (Step) is
  - the next token of every generating job (all of them, every step: generation is never starved), then
  - at most `chunk` prompt tokens, taken first come first served from jobs still reading their prompt.
Jobs join between steps when a slot is free and leave when they finish or their client goes away
(cancel(): the slot is free at the next step). Waiting jobs queue up to `max_queue`; beyond that submit()
raises QueueFull. A job that generates alone (nothing else running or waiting) with no logprobs and no
response_format makes a lone step: the runner decodes it and takes its token in one native call.

Prefix cache: a slot keeps the tokens its KV holds after its job leaves. A new job takes the free slot
whose cache shares the longest prefix with its prompt, or copies a longer prefix from any other slot, and
runs only the rest; jobs reading a common prefix at the same time compute it once.

CPU attention offload (offload.py): when the model's device holds the KV cache of fewer sequences than
there are slots (optiml serve --kv-vram), a job that finds every device slot busy starts in a host slot,
its attention on the CPU, if the policy's measured cost model says the step's throughput goes up within
--max-itl-ms; otherwise it waits. A device slot freed by a finishing job goes to a running host job.

The KV cache operations it decides go to `kv` (the Runner; a fake in tests): n_seq, kv_copy(src, dst, n),
kv_truncate(seq, n), kv_where(seq) -> "device" | "host", kv_place(seq, where). submit, cancel and status
are called from the server's event loop; everything else from the pipeline's thread (pipeline.py).
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..engine.batch import Batch
from .offload import StepFeatures


class QueueFull(Exception):
    pass


class TooManySequences(QueueFull):
    """A request of more sequences (prompts times n) than the slots and the queue hold together: it could
    never be admitted, however long it waited."""


class Job:
    """One sequence to generate. `sink(event)` is called from the pipeline's thread with dicts:
    {"type": "delta", "index", "text", "logprobs": [(tok, logprob, [(tok, logprob), ...]), ...]},
    {"type": "done", "index", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
     "t_start", "t_first", "t_end"} (times: time.perf_counter() when the job took its slot, when its first
    token came, when it ended),
    {"type": "error", "index", "message"}."""

    def __init__(self, index: int, prompt: list, max_tokens: int | None, sampler, stops: list, sink,
                 top_logprobs: int = -1, logit_bias: dict | None = None, constraint=None):
        self.index = index
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.stops = stops
        self.sink = sink
        self.top_logprobs = top_logprobs  # -1: no logprobs
        self.logit_bias = logit_bias or {}
        self.constraint = constraint
        self.cancelled = False
        self.slot = None
        self.n_done = 0  # prompt tokens in the KV cache
        self.cached = 0  # of which came from the prefix cache
        self.next_token = None  # sampled, to be run next step
        self.generated: list[int] = []
        self.t_arrival = time.perf_counter()
        self.t_start = None  # when it took a slot (its prompt's reading starts)
        self.t_first = None  # when its first token came (its prompt is read)
        self.t_last = None
        self.output = None  # the native output stage (output.py), made at the first token
        # A job without logprobs or a grammar takes the lone step when it runs alone.
        self.plain = top_logprobs < 0 and constraint is None


class Slot:
    def __init__(self, index: int):
        self.index = index
        self.tokens: list[int] = []  # what this slot's KV cache holds
        self.job: Job | None = None
        self.reserved = False  # an embedding runs in it (the pipeline's, across steps)
        self.last_used = 0.0

    @property
    def free(self) -> bool:
        return self.job is None and not self.reserved


@dataclass
class Step:
    """One step the scheduler decided: the jobs holding a slot (`active`), the generating jobs whose
    next token runs (`gen`), the prompt chunks that run (`prefill`: job, its tokens from job.n_done on),
    the jobs whose logits come back, in batch order (`rows`), and those tokens as a Batch. A lone step
    (`lone`) runs that job's next token alone."""

    active: list
    gen: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    lone: Job | None = None
    batch: Batch = field(default_factory=Batch)

    @classmethod
    def alone(cls, j: Job) -> "Step":
        """The lone step of `j`: its next token, alone."""
        batch = Batch().add(j.next_token, j.slot.index, len(j.slot.tokens), logits=True)
        return cls([j], gen=[j], rows=[j], lone=j, batch=batch)

    @property
    def n_tokens(self) -> int:
        return len(self.batch)


def _common(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, kv, n_parallel: int, max_queue: int, chunk: int = 256, policy=None, metrics=None):
        if n_parallel > kv.n_seq:
            raise ValueError(f"n_parallel ({n_parallel}) exceeds the model's sequence slots ({kv.n_seq})")
        self.kv = kv
        self.policy = policy  # an OffloadPolicy when the device holds fewer sequences than there are slots
        self.slots = [Slot(i) for i in range(n_parallel)]
        self.max_queue = max_queue
        self.chunk = chunk
        self.metrics = metrics
        self.waiting: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False

    # ---- called from the server's event loop ----------------------------------------------------------
    def submit(self, jobs: list) -> None:
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            most = self.max_queue + len(self.slots)
            if len(jobs) > most:
                raise TooManySequences(f"the request makes {len(jobs)} sequences (prompts times n); this server "
                                       f"takes at most {most} at once (--parallel {len(self.slots)} and "
                                       f"--queue {self.max_queue})")
            free = sum(s.free for s in self.slots)
            if len(self.waiting) + len(jobs) > self.max_queue + free:  # the free slots take the first ones
                raise QueueFull(f"{len(self.waiting)} sequences are already waiting for {free} free slots and "
                                f"--queue {self.max_queue}")
            self.waiting.extend(jobs)
            self.gauges()
            self.cond.notify()

    def cancel(self, jobs: list) -> None:
        with self.cond:
            for j in jobs:
                j.cancelled = True
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def status(self) -> dict:
        with self.cond:
            busy = sum(s.job is not None for s in self.slots)
            return {"slots_idle": len(self.slots) - busy, "slots_processing": busy, "queue": len(self.waiting)}

    def busy(self) -> bool:
        """Whether a job holds a slot or waits for one."""
        with self.cond:
            return bool(self.waiting) or any(s.job is not None for s in self.slots)

    # ---- the pipeline's thread ----------------------------------------------------------------------------
    def gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(sum(s.job is not None for s in self.slots))

    def jobs(self) -> list:
        """Every job holding a slot, then every waiting one (under the lock)."""
        return [s.job for s in self.slots if s.job is not None] + list(self.waiting)

    def drop_cancelled(self) -> bool:
        """Frees the slots of jobs whose client went away and forgets cancelled waiting jobs (under the
        lock). True when something changed."""
        changed = False
        for s in self.slots:
            if s.job is not None and s.job.cancelled:
                s.job = None  # the slot is free now (its KV stays as cache)
                changed = True
        if any(j.cancelled for j in self.waiting):
            self.waiting = collections.deque(j for j in self.waiting if not j.cancelled)
            changed = True
        return changed

    def admit(self, fail) -> bool:
        """Admits waiting jobs in order while slots are free and the policy agrees, then (with offload)
        moves running host jobs to freed device slots. A job whose admission fails (a KV copy error) goes
        to `fail(job, message)` alone. True when something changed. Runs outside the lock (only this
        thread changes the slots): a long KV copy must not hold up submit, cancel and status."""
        changed = False
        while True:
            with self.cond:
                if not self.waiting or not any(s.free for s in self.slots):
                    break
                job = self.waiting[0]  # stays the head: only this thread takes jobs out
            try:
                if not self._admit(job):
                    break  # the policy keeps it waiting for a device slot
                error = None
            except Exception as e:
                traceback.print_exc()
                error = e
            with self.cond:
                self.waiting.popleft()
            changed = True
            if error is not None:
                fail(job, f"could not start: {error}")
        if self.policy is not None:
            changed |= self._promote()
        return changed

    def _admit(self, job: Job) -> bool:
        """Gives `job` a free slot, reusing the longest cached prefix of its prompt. With offload, a slot
        whose KV cache is on the device if there is one; else a host slot if the policy agrees (False:
        the job keeps waiting)."""
        free = [s for s in self.slots if s.free]
        if self.policy is not None:
            on_device = [s for s in free if self.kv.kv_where(s.index) == "device"]
            if on_device:
                free = on_device
            else:
                ok = self.policy.admit_on_host(self._features(), len(job.prompt))
                if self.metrics:
                    self.metrics.offload_decisions.labels(self.policy.last[0].split(":")[0]).inc()
                if not ok:
                    return False
        slot = max(free, key=lambda s: (_common(s.tokens, job.prompt), -s.last_used))
        keep = _common(slot.tokens, job.prompt)
        donor = max(self.slots, key=lambda s: _common(s.tokens, job.prompt))
        try:
            if donor is not slot and _common(donor.tokens, job.prompt) > keep:
                keep = _common(donor.tokens, job.prompt)
                self.kv.kv_copy(donor.index, slot.index, keep)
                slot.tokens = donor.tokens[:keep]
            keep = min(keep, len(job.prompt) - 1)  # the last prompt token runs: its logits start generation
            self.kv.kv_truncate(slot.index, keep)
        except Exception:
            slot.tokens = []  # what its KV holds is unknown now: never reuse it as a prefix
            raise
        del slot.tokens[keep:]
        slot.job, job.slot = job, slot
        job.n_done = job.cached = keep
        job.t_start = time.perf_counter()
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(job.prompt))
        return True

    def _features(self) -> StepFeatures:
        """The next step's features for the cost model: one token per running job (its prompt counts as
        its first step's attention), split by where each job's KV cache lives."""
        f = StepFeatures(0, 0, 0)
        for j in (s.job for s in self.slots if s.job is not None):
            kv = len(j.slot.tokens) + 1 if j.next_token is not None else len(j.prompt)
            f.tokens += 1
            if self.kv.kv_where(j.slot.index) == "host":
                f.kv_host += kv
            else:
                f.kv_device += kv
        return f

    def _promote(self) -> bool:
        """A device slot held by an idle slot's cache goes to a running job on the host: the idle cache
        moves to the host, the job's to the device. True when something moved."""
        where = {s.index: self.kv.kv_where(s.index) for s in self.slots}
        moved = False
        for s in self.slots:
            if s.job is None or where[s.index] != "host":
                continue
            idle = next((t for t in self.slots if t.free and where[t.index] == "device"), None)
            if idle is None:
                break
            try:
                self.kv.kv_place(idle.index, "host")
                self.kv.kv_place(s.index, "device")
            except Exception:  # the job runs on where its cache is; the next round reads the places anew
                traceback.print_exc()
                where = {t.index: self.kv.kv_where(t.index) for t in self.slots}
                break
            where[idle.index], where[s.index] = "host", "device"
            moved = True
        if self.metrics:
            self.metrics.host_sequences.set(sum(1 for s in self.slots if s.job is not None and where[s.index] == "host"))
        return moved

    def schedule(self) -> Step | None:
        """The next step over the jobs holding a slot; None when no job does."""
        with self.cond:
            active = [s.job for s in self.slots if s.job is not None]
            alone = len(active) == 1 and not self.waiting
        if not active:
            return None
        if alone and active[0].plain and active[0].next_token is not None:
            return Step.alone(active[0])
        step = Step(active)
        step.gen = [j for j in active if j.next_token is not None]
        step.rows = list(step.gen)
        for j in step.gen:
            step.batch.add(j.next_token, j.slot.index, len(j.slot.tokens), logits=True)
        budget = self.chunk
        reading = sorted((j for j in active if j.next_token is None), key=lambda j: j.t_arrival)
        for k, j in enumerate(reading):
            if budget <= 0:
                break
            if self._follow(j, step.gen + reading[:k]):
                continue  # an earlier job is computing this job's prefix: wait for it, then copy
            rest = j.prompt[j.n_done:]
            take = rest[:budget]
            last = len(take) == len(rest)
            step.batch.add_sequence(take, j.slot.index, j.n_done, logits="last" if last else "none")
            step.prefill.append((j, take))
            if last:
                step.rows.append(j)
            budget -= len(take)
        return step

    def _follow(self, j: Job, earlier: list) -> bool:
        """Shares a prompt prefix between jobs that read their prompts at the same time (n > 1, a common
        system prompt): the later job waits while an earlier one computes the shared part, then copies
        its KV. True while `j` should wait this step."""
        for lead in earlier:
            c = min(_common(lead.prompt, j.prompt), len(j.prompt) - 1)
            if c <= j.n_done:
                continue
            if lead.n_done < c:
                return True
            self.kv.kv_copy(lead.slot.index, j.slot.index, c)
            j.slot.tokens = lead.slot.tokens[:c]
            j.cached += c - j.n_done
            j.n_done = c
            return False
        return False

    def step_features(self, batch: Batch) -> StepFeatures:
        """What the cost model reads of a step: its tokens and the positions each attends over, by where
        its sequence's KV cache lives."""
        where = {}
        f = StepFeatures(len(batch), 0, 0)
        for seq, pos in zip(batch.seq, batch.pos):
            if seq not in where:
                where[seq] = self.kv.kv_where(seq)
            if where[seq] == "host":
                f.kv_host += pos + 1
            else:
                f.kv_device += pos + 1
        return f

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """A step's measured time, for the offload policy's cost model."""
        self.policy.cost.observe(features, seconds)
        if self.metrics:
            self.metrics.offload_steps.labels("pipelined" if features.pipelined else "gpu_only").inc()

    def ran(self, step: Step, now: float) -> None:
        """The step ran: each slot's KV holds its tokens."""
        for j in step.gen:
            j.slot.tokens.append(j.next_token)
            j.next_token = None
        for j, take in step.prefill:
            j.slot.tokens.extend(take)
            j.n_done += len(take)
        for j in step.rows:
            j.slot.last_used = now

    def release(self, j: Job) -> None:
        """`j` has finished (or failed): its slot is free, its KV stays as cache."""
        with self.cond:
            if j.slot is not None and j.slot.job is j:
                j.slot.job = None
            j.next_token = None
            self.gauges()
