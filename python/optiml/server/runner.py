"""The runner: steps the model for the scheduler. It owns the Model's side of the pipeline: a batched step
(Model.decode of the scheduler's Batch: every running sequence advances, sharing each weight read), a lone
step (Model._step_sequence: one sequence decoded and taken through its output stage in one native call,
the GIL released, so a lone client waits on as little Python per token as Model.generate's does), the KV
cache operations the scheduler decides, and the FFN sparsity each step showed (/metrics)."""

from __future__ import annotations

import numpy as np

from ..engine.batch import Batch


class Runner:
    def __init__(self, model, metrics=None):
        self.model = model
        self.metrics = metrics
        # The FFN neurons each step skipped (read in this thread after each step; /metrics shows them).
        self.sparsity = model.sparsity_meter(history=1024)
        if metrics:
            metrics.sparsity_in_use(model.sparsity, model.predictors)

    @property
    def n_seq(self) -> int:
        return self.model.n_seq

    # ---- the KV cache (looked up on the model at each call: tests wrap its methods) ----------------------
    def kv_copy(self, src: int, dst: int, n: int) -> None:
        self.model.kv_copy(src, dst, n)

    def kv_truncate(self, seq: int, n: int) -> None:
        self.model.kv_truncate(seq, n)

    def kv_where(self, seq: int) -> str:
        return self.model.kv_where(seq)

    def kv_place(self, seq: int, where: str) -> None:
        self.model.kv_place(seq, where)

    def hidden_states(self, ids: list, seq: int) -> np.ndarray:
        """[len(ids), n_embd]: the final hidden states of ids run in sequence `seq` (embeddings)."""
        return self.model._session.hidden_states(np.asarray(ids, np.int32), seq)

    # ---- steps --------------------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> np.ndarray:
        """Logits [tokens that want them, n_vocab] of one batched step."""
        logits = self.model.decode(batch)
        self._sparsity_step()
        return logits

    def step_lone(self, seq: int, pos: int, token: int, output, allowed, last: bool) -> tuple:
        """Runs `token` at `pos` of sequence `seq` and takes the next token through `output` (the job's
        native output stage): what output.step returns."""
        r = self.model._step_sequence(seq, pos, token, output, allowed, last)
        self._sparsity_step()
        return r

    def _sparsity_step(self) -> None:
        """Records the step just run in the sparsity meter and the metrics."""
        m = self.sparsity
        seen, active = m.seen, m.active
        if m.step() is not None and self.metrics:
            self.metrics.sparsity_step(m, seen, active)
