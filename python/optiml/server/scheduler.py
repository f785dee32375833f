"""Continuous batching: one thread owns the Model and advances every running sequence each step.

Each choice of a request is a Job with its own KV slot. A step is one Model.decode of
  - the next token of every generating job (all of them, every step: generation is never starved), then
  - at most `chunk` prompt tokens, taken first come first served from jobs still reading their prompt.
Jobs join between steps when a slot is free and leave when they finish or their client goes away
(cancel(): the slot is free at the next step). Waiting jobs queue up to `max_queue`; beyond that submit()
raises QueueFull.

Prefix cache: a slot keeps the tokens its KV holds after its job leaves. A new job takes the free slot
whose cache shares the longest prefix with its prompt, or copies a longer prefix from any other slot
(Model.kv_copy), and runs only the rest; jobs reading a common prefix at the same time compute it once.
Each row of logits goes through the job's native output stage (engine.generation.output_stage: bias,
response_format mask, sampling, logprobs, detokenization, stop strings), the per-token step of
Model.generate, so a greedy job gets the text Model.generate/chat gives for the same prompt.

CPU attention offload (offload.py): when the model's device holds the KV cache of fewer sequences than
there are slots (optiml serve --kv-vram), a job that finds every device slot busy starts in a host slot,
its attention on the CPU, if the policy's measured cost model says the step's throughput goes up within
--max-itl-ms; otherwise it waits. A device slot freed by a finishing job goes to a running host job.

A job that generates alone (nothing else running or waiting) with no logprobs and no response_format
takes each token in one native call (Model._step_sequence: decode and the output stage, with the GIL
released), so a lone client waits on as little Python per token as
Model.generate's does. It goes back to batched steps as soon as another job arrives.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback

from ..engine.batch import Batch
from ..engine.generation import output_stage


class QueueFull(Exception):
    pass


class Job:
    """One sequence to generate. `sink(event)` is called from the scheduler thread with dicts:
    {"type": "delta", "index", "text", "logprobs": [(tok, logprob, [(tok, logprob), ...]), ...]},
    {"type": "done", "index", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"},
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
        self.t_last = None
        self.output = None  # the native output stage, made when the job is admitted
        # A job without logprobs or a grammar can take its tokens natively when it runs alone.
        self.plain = top_logprobs < 0 and constraint is None


class Slot:
    def __init__(self, index: int):
        self.index = index
        self.tokens: list[int] = []  # what this slot's KV cache holds
        self.job: Job | None = None
        self.last_used = 0.0


def _common(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, model, n_parallel: int, max_queue: int, chunk: int = 256, metrics=None, policy=None):
        if n_parallel > model.n_seq:
            raise ValueError(f"n_parallel ({n_parallel}) exceeds the model's sequence slots ({model.n_seq})")
        self.policy = policy  # an OffloadPolicy when the device holds fewer sequences than there are slots
        self.model = model
        self.tokenizer = model.tokenizer
        self.n_ctx = model.n_ctx
        self.slots = [Slot(i) for i in range(n_parallel)]
        self.max_queue = max_queue
        self.chunk = chunk
        self.metrics = metrics
        self.waiting: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.steps = 0
        # The FFN neurons each step skipped (read in this thread after each step; /metrics shows them).
        self.sparsity = model.sparsity_meter(history=1024)
        if metrics:
            metrics.sparsity_in_use(model.sparsity, model.predictors)
        self.thread = threading.Thread(target=self._run, name="optiml-scheduler", daemon=True)

    # ---- called from the server's event loop ----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def submit(self, jobs: list) -> None:
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            free = sum(s.job is None for s in self.slots)
            if len(self.waiting) + len(jobs) > self.max_queue + free:  # the free slots take the first ones
                raise QueueFull(f"{len(self.waiting)} sequences are already waiting (--queue {self.max_queue})")
            self.waiting.extend(jobs)
            self._gauges()
            self.cond.notify()

    def cancel(self, jobs: list) -> None:
        with self.cond:
            for j in jobs:
                j.cancelled = True
            self.cond.notify()

    def status(self) -> dict:
        with self.cond:
            busy = sum(s.job is not None for s in self.slots)
            return {"slots_idle": len(self.slots) - busy, "slots_processing": busy, "queue": len(self.waiting)}

    # ---- the scheduler thread ---------------------------------------------------------------------------
    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(sum(s.job is not None for s in self.slots))

    def _run(self) -> None:
        while True:
            with self.cond:
                changed = self._drop_cancelled()
                if self.stopping:
                    for j in [s.job for s in self.slots if s.job is not None] + list(self.waiting):
                        j.sink({"type": "error", "index": j.index, "message": "the server is shutting down"})
                    return
                if not self.waiting and all(s.job is None for s in self.slots):
                    if changed:
                        self._gauges()
                    self.cond.wait()
                    continue
            # Admissions and KV moves run outside the lock (only this thread changes the slots): a long KV
            # copy (a shared prefix, a cache moving between the device and the host) must not hold up the
            # event loop's submit, cancel and status.
            changed |= self._admit_waiting()
            if self.policy is not None:
                changed |= self._promote()
            with self.cond:
                if changed:
                    self._gauges()
                active = [s.job for s in self.slots if s.job is not None]
                lone = active[0] if len(active) == 1 and not self.waiting else None
            if not active:
                if not changed:  # waiting jobs the policy keeps waiting: sleep until something happens
                    with self.cond:
                        self.cond.wait(timeout=0.1)
                continue
            try:
                if lone is not None and lone.plain and lone.next_token is not None:
                    self._lone_step(lone)
                else:
                    self._step(active)
            except Exception as e:  # a failed step fails its jobs, not the server
                traceback.print_exc()
                for j in active:
                    self._fail(j, f"generation failed: {e}")

    def _drop_cancelled(self) -> bool:
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

    def _admit_waiting(self) -> bool:
        """Admits waiting jobs in order while slots are free and the policy agrees. A job whose admission
        fails (a KV copy error) fails alone. True when the queue changed."""
        changed = False
        while True:
            with self.cond:
                if not self.waiting or all(s.job is not None for s in self.slots):
                    return changed
                job = self.waiting[0]  # stays the head: only this thread takes jobs out
            try:
                if not self._admit(job):
                    return changed  # the policy keeps it waiting for a device slot
                error = None
            except Exception as e:
                traceback.print_exc()
                error = e
            with self.cond:
                self.waiting.popleft()
            changed = True
            if error is not None:
                self._fail(job, f"could not start: {error}")

    def _admit(self, job: Job) -> bool:
        """Gives `job` a free slot, reusing the longest cached prefix of its prompt. With offload, a slot
        whose KV cache is on the device if there is one; else a host slot if the policy agrees (False:
        the job keeps waiting)."""
        free = [s for s in self.slots if s.job is None]
        if self.policy is not None:
            on_device = [s for s in free if self.model.kv_where(s.index) == "device"]
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
                self.model.kv_copy(donor.index, slot.index, keep)
                slot.tokens = donor.tokens[:keep]
            keep = min(keep, len(job.prompt) - 1)  # the last prompt token runs: its logits start generation
            self.model.kv_truncate(slot.index, keep)
        except Exception:
            slot.tokens = []  # what its KV holds is unknown now: never reuse it as a prefix
            raise
        del slot.tokens[keep:]
        slot.job, job.slot = job, slot
        job.n_done = job.cached = keep
        job.sampler.accept(job.prompt)  # the prompt counts for the penalties, as in Model.stream
        job.output = output_stage(self.tokenizer, job.sampler, job.stops, job.logit_bias, job.top_logprobs)
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(job.prompt))
        return True

    def _features(self, jobs=None):
        """The next step's features for the cost model: one token per running job (its prompt counts as
        its first step's attention), split by where each job's KV cache lives."""
        from .offload import StepFeatures

        f = StepFeatures(0, 0, 0)
        for j in jobs if jobs is not None else [s.job for s in self.slots if s.job is not None]:
            kv = len(j.slot.tokens) + 1 if j.next_token is not None else len(j.prompt)
            f.tokens += 1
            if self.model.kv_where(j.slot.index) == "host":
                f.kv_host += kv
            else:
                f.kv_device += kv
        return f

    def _promote(self) -> bool:
        """A device slot held by an idle slot's cache goes to a running job on the host: the idle cache
        moves to the host, the job's to the device. True when something moved."""
        where = {s.index: self.model.kv_where(s.index) for s in self.slots}
        moved = False
        for s in self.slots:
            if s.job is None or where[s.index] != "host":
                continue
            idle = next((t for t in self.slots if t.job is None and where[t.index] == "device"), None)
            if idle is None:
                break
            try:
                self.model.kv_place(idle.index, "host")
                self.model.kv_place(s.index, "device")
            except Exception:  # the job runs on where its cache is; the next round reads the places anew
                traceback.print_exc()
                where = {t.index: self.model.kv_where(t.index) for t in self.slots}
                break
            where[idle.index], where[s.index] = "host", "device"
            moved = True
        if self.metrics:
            self.metrics.host_sequences.set(sum(1 for s in self.slots if s.job is not None and where[s.index] == "host"))
        return moved

    def _step(self, active: list) -> None:
        batch = Batch()
        rows: list[Job] = []
        gen = [j for j in active if j.next_token is not None]
        for j in gen:
            batch.add(j.next_token, j.slot.index, len(j.slot.tokens), logits=True)
            rows.append(j)
        budget = self.chunk
        prefill = []
        reading = sorted((j for j in active if j.next_token is None), key=lambda j: j.t_arrival)
        for k, j in enumerate(reading):
            if budget <= 0:
                break
            if self._follow(j, gen + reading[:k]):
                continue  # an earlier job is computing this job's prefix: wait for it, then copy
            rest = j.prompt[j.n_done:]
            take = rest[:budget]
            last = len(take) == len(rest)
            batch.add_sequence(take, j.slot.index, j.n_done, logits="last" if last else "none")
            prefill.append((j, take))
            if last:
                rows.append(j)
            budget -= len(take)
        features = self._step_features(batch) if self.policy is not None else None
        t0 = time.perf_counter()
        logits = self.model.decode(batch)
        self._sparsity_step()
        if features is not None:
            self.policy.cost.observe(features, time.perf_counter() - t0)
            if self.metrics:
                self.metrics.offload_steps.labels("pipelined" if features.pipelined else "gpu_only").inc()
        self.steps += 1
        if self.metrics:
            self.metrics.batch_tokens.observe(len(batch))
            self.metrics.batch_sequences.observe(len(gen) + len(prefill))
            self.metrics.prompt_evaluated.inc(sum(len(t) for _, t in prefill))
        now = time.perf_counter()
        for j in gen:
            j.slot.tokens.append(j.next_token)
            j.next_token = None
        for j, take in prefill:
            j.slot.tokens.extend(take)
            j.n_done += len(take)
        for j, row in zip(rows, logits):
            j.slot.last_used = now
            if not j.cancelled:
                self._take(j, j.output.step(row, self._allowed(j), self._last(j, len(j.slot.tokens))), now)

    def _sparsity_step(self) -> None:
        """Records the step just run in the sparsity meter and the metrics."""
        m = self.sparsity
        seen, active = m.seen, m.active
        if m.step() is not None and self.metrics:
            self.metrics.sparsity_step(m, seen, active)

    def _step_features(self, batch: Batch):
        """What the cost model reads of a step: its tokens and the positions each attends over, by where
        its sequence's KV cache lives."""
        from .offload import StepFeatures

        where = {}
        f = StepFeatures(len(batch), 0, 0)
        for seq, pos in zip(batch.seq, batch.pos):
            if seq not in where:
                where[seq] = self.model.kv_where(seq)
            if where[seq] == "host":
                f.kv_host += pos + 1
            else:
                f.kv_device += pos + 1
        return f

    def _lone_step(self, j: Job) -> None:
        """One token of a plain job running alone, in one native call (decode and output stage)."""
        pos = len(j.slot.tokens)
        result = self.model._step_sequence(j.slot.index, pos, j.next_token, j.output, self._allowed(j),
                                           self._last(j, pos + 1))
        self.steps += 1
        self._sparsity_step()
        now = time.perf_counter()
        j.slot.tokens.append(j.next_token)
        j.next_token = None
        j.slot.last_used = now
        if self.metrics:
            self.metrics.batch_tokens.observe(1)
            self.metrics.batch_sequences.observe(1)
        self._take(j, result, now)

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
            self.model.kv_copy(lead.slot.index, j.slot.index, c)
            j.slot.tokens = lead.slot.tokens[:c]
            j.cached += c - j.n_done
            j.n_done = c
            return False
        return False

    @staticmethod
    def _allowed(j: Job):
        """The tokens the job's response_format allows now (a bitmask), or None."""
        return None if j.constraint is None else j.constraint.allowed()

    def _last(self, j: Job, n_kv: int) -> bool:
        """Whether the token sampled now is the job's last (max_tokens, or a full context: the last sampled
        token is not run, as in Model.stream)."""
        return (j.max_tokens is not None and len(j.generated) + 1 >= j.max_tokens) or n_kv >= self.n_ctx

    def _take(self, j: Job, result: tuple, now: float) -> None:
        """One token's result from the output stage (token, end, text, logprobs) to the job's sink."""
        tok, end, text, lp = result
        if self.metrics:
            if j.t_last is None:
                self.metrics.ttft.observe(now - j.t_arrival)
            else:
                self.metrics.itl.observe(now - j.t_last)
        j.t_last = now
        if tok >= 0:
            j.generated.append(tok)
            if self.metrics:
                self.metrics.generated_tokens.inc()
            if j.constraint is not None:
                j.constraint.accept(tok)
                if j.constraint.error():
                    return self._fail(j, f"response_format: {j.constraint.error()}")
                if end != "stop" and j.constraint.done():  # the grammar is complete
                    text += j.output.flush() if end is None else ""
                    end = "stop"
        lps = [] if lp is None else [(tok, lp[0], lp[1])]
        if end is not None:
            return self._finish(j, end, text, lps)
        if text or lps:
            j.sink({"type": "delta", "index": j.index, "text": text, "logprobs": lps})
        j.next_token = tok

    def _finish(self, j: Job, reason: str, text: str, lps: list) -> None:
        if text or lps:
            j.sink({"type": "delta", "index": j.index, "text": text, "logprobs": lps})
        j.sink({"type": "done", "index": j.index, "finish_reason": reason, "prompt_tokens": len(j.prompt),
                "completion_tokens": len(j.generated), "cached_tokens": j.cached})
        self._release(j)

    def _fail(self, j: Job, message: str) -> None:
        j.sink({"type": "error", "index": j.index, "message": message})
        self._release(j)

    def _release(self, j: Job) -> None:
        with self.cond:
            if j.slot is not None and j.slot.job is j:
                j.slot.job = None
            j.next_token = None
            self._gauges()
