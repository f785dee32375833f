"""Continuous batching: one thread owns the Model and runs the pipeline, step after step.

    scheduler (scheduler.py)  decides: admissions, slots, the prefix cache, CPU attention offload, which
                              tokens go into the next step
    runner (runner.py)        steps the model: a Batch through Model.decode, or one lone sequence
    output stage (output.py)  each job's row of logits -> its token and text, natively (Model.generate's
                              per-token step), then the job's events

A job that generates alone (nothing else running or waiting) with no logprobs and no response_format
takes each token in one native call (decode and output stage, the GIL released); it goes back to batched
steps as soon as another job arrives. A step that fails fails its jobs, not the server.

Embedding requests (/v1/embeddings) run between steps, one input at a time in a slot reserved for it (emptied
before and after: its cached prefix is forgotten), in pieces of at most `chunk` tokens as prompts are, so that a
long input holds the running streams up no longer than a prompt does; requests take turns input by input.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from concurrent.futures import Future

import numpy as np

from ..engine.embeddings import pool

from .output import OutputStage
from .runner import Runner
from .scheduler import QueueFull, Scheduler, Step

__all__ = ["Embedding", "Pipeline", "QueueFull"]


class Embedding:
    """One /v1/embeddings request in the pipeline: its token id lists, their vectors so far (fut's result once
    all are in), the current input's hidden states so far and its slot."""

    def __init__(self, inputs: list, pooling: str):
        self.inputs, self.pooling = inputs, pooling
        self.fut = Future()
        self.vectors: list = []
        self.states: list = []
        self.slot = None
        self.cancelled = False  # (set by the server's thread: the client left, or the server stops)


class Pipeline:
    def __init__(self, model, n_parallel: int, max_queue: int, chunk: int = 256, metrics=None, policy=None):
        self.runner = Runner(model, metrics)
        self.scheduler = Scheduler(self.runner, n_parallel, max_queue, chunk, policy, metrics)
        self.output = OutputStage(model.tokenizer, model.n_ctx, metrics)
        self.metrics = metrics
        self.steps = 0
        self._embeds: collections.deque[Embedding] = collections.deque()
        self.thread = threading.Thread(target=self._run, name="optiml-scheduler", daemon=True)

    # ---- called from the server's event loop ----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.thread.join(timeout=30)

    def submit(self, jobs: list) -> None:
        """Queues jobs (scheduler.Job); QueueFull when the queue is full or the server is stopping."""
        self.scheduler.submit(jobs)

    def cancel(self, jobs: list) -> None:
        self.scheduler.cancel(jobs)

    def embed(self, inputs: list, pooling: str) -> Embedding:
        """Queues token id lists to embed (unit vectors, `pooling`); the Embedding's fut gives their vectors.
        QueueFull when the server is stopping or --queue requests already wait; cancel it with its .cancelled."""
        task = Embedding([list(x) for x in inputs], pooling)
        with self.scheduler.cond:
            if self.scheduler.stopping:
                raise QueueFull("the server is shutting down")
            if len(self._embeds) >= max(1, self.scheduler.max_queue):
                raise QueueFull(f"{len(self._embeds)} embedding requests are already waiting (--queue "
                                f"{self.scheduler.max_queue})")
            self._embeds.append(task)
            self.scheduler.cond.notify_all()
        return task

    def status(self) -> dict:
        return self.scheduler.status()

    @property
    def stopping(self) -> bool:
        return self.scheduler.stopping

    @property
    def policy(self):
        return self.scheduler.policy

    @property
    def n_parallel(self) -> int:
        return len(self.scheduler.slots)

    # ---- the pipeline's thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        s = self.scheduler
        while True:
            with s.cond:
                changed = s.drop_cancelled()
                if s.stopping:
                    for j in s.jobs():
                        self.output.fail(j, "the server is shutting down")
                    for task in self._embeds:
                        if not task.fut.done():
                            task.fut.set_exception(QueueFull("the server is shutting down"))
                    return
                embed = bool(self._embeds) and (self._embeds[0].slot is not None or any(x.free for x in s.slots))
                if not embed and not s.waiting and all(slot.job is None for slot in s.slots):
                    if changed:
                        s.gauges()
                    s.cond.wait()
                    continue
            if embed:  # (this thread alone admits jobs and reserves slots)
                self._embed_next()
            changed |= s.admit(self._fail)
            if changed:
                with s.cond:
                    s.gauges()
            step = s.schedule()
            if step is None:
                if not changed and not embed:  # waiting jobs the policy keeps waiting: sleep until something happens
                    with s.cond:
                        s.cond.wait(timeout=0.1)
                continue
            try:
                if step.lone is not None:
                    self._lone_step(step.lone)
                else:
                    self._step(step)
            except Exception as e:  # a failed step fails its jobs, not the server
                traceback.print_exc()
                for j in step.active:
                    self._fail(j, f"generation failed: {e}")

    def _embed_next(self) -> None:
        """The next piece (at most `chunk` tokens) of the first queued request's current input, in its reserved
        slot (a free one reserved at the input's start: _run checked there is one)."""
        task = self._embeds[0]
        if task.cancelled:
            self._embed_done(task)
            return
        try:
            if task.slot is None:
                task.slot = min((x for x in self.scheduler.slots if x.free),
                                key=lambda x: (len(x.tokens) > 0, x.last_used))  # an empty one, else the oldest
                task.slot.reserved = True
                task.slot.tokens = []  # (what its KV holds is no prefix of anything after this)
                self.runner.kv_truncate(task.slot.index, 0)
            ids = task.inputs[len(task.vectors)]
            ran = sum(len(h) for h in task.states)
            task.states.append(self.runner.hidden_states(ids[ran:ran + self.scheduler.chunk], task.slot.index))
            if ran + len(task.states[-1]) < len(ids):
                return
            task.vectors.append(pool(np.concatenate(task.states), task.pooling, True))
            task.states = []
            self._release(task)
        except Exception as e:  # (a bad input fails its request, not the server)
            self._embed_done(task, error=e)
            return
        if len(task.vectors) == len(task.inputs):
            self._embed_done(task)
        else:
            self._embeds.rotate(-1)  # the next request's input next

    def _release(self, task: Embedding) -> None:
        if task.slot is not None:
            slot, task.slot = task.slot, None
            slot.reserved = False
            self.runner.kv_truncate(slot.index, 0)

    def _embed_done(self, task: Embedding, error: Exception | None = None) -> None:
        self._embeds.remove(task)
        try:
            self._release(task)
        finally:
            if task.cancelled:
                task.fut.cancel()
            elif error is not None:
                task.fut.set_exception(error)
            else:
                task.fut.set_result(task.vectors)

    def _step(self, step: Step) -> None:
        s = self.scheduler
        features = s.step_features(step.batch) if s.policy is not None else None
        t0 = time.perf_counter()
        logits = self.runner.decode(step.batch)
        if features is not None:
            s.observe(features, time.perf_counter() - t0)
        self._count(step)
        if self.metrics:
            self.metrics.prompt_evaluated.inc(sum(len(t) for _, t in step.prefill))
        now = time.perf_counter()
        s.ran(step, now)
        for j, row in zip(step.rows, logits):
            if not j.cancelled:
                self._deliver(j, self.output.sample(j, row, len(j.slot.tokens)), now)

    def _lone_step(self, j) -> None:
        """One token of a plain job running alone, in one native call (decode and output stage)."""
        step = Step.alone(j)
        pos = len(j.slot.tokens)
        out = self.output
        result = self.runner.step_lone(j.slot.index, pos, j.next_token, out.stage(j), out.allowed(j),
                                       out.last(j, pos + 1))
        self._count(step)
        now = time.perf_counter()
        self.scheduler.ran(step, now)
        self._deliver(j, result, now)

    def _count(self, step: Step) -> None:
        self.steps += 1
        if self.metrics:
            self.metrics.batch_tokens.observe(step.n_tokens)
            self.metrics.batch_sequences.observe(len(step.gen) + len(step.prefill))

    def _deliver(self, j, result: tuple, now: float) -> None:
        if self.output.deliver(j, result, now):
            self.scheduler.release(j)
        else:
            j.next_token = result[0]

    def _fail(self, j, message: str) -> None:
        self.output.fail(j, message)
        self.scheduler.release(j)
