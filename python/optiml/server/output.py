"""The output stage: what becomes of a job's row of logits. The work per token is native and the same as
Model.generate's (engine.generation.output_stage: logit bias, the response_format mask, sampling,
logprobs, end of generation, detokenization, stop strings), so a greedy job gets the text Model.generate
gives for the same prompt. Here, around it: the allowed-token mask of a response_format (structured.py)
going in, the grammar taking the token, the job's events (its sink) and the per-token metrics."""

from __future__ import annotations

from ..engine.generation import output_stage


class OutputStage:
    def __init__(self, tokenizer, n_ctx: int, metrics=None):
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.metrics = metrics

    # ---- what goes into the native stage -------------------------------------------------------------------
    def stage(self, j):
        """The job's native output stage, made at its first token."""
        if j.output is None:
            j.sampler.accept(j.prompt)  # the prompt counts for the penalties, as in Model.stream
            j.output = output_stage(self.tokenizer, j.sampler, j.stops, j.logit_bias, j.top_logprobs)
        return j.output

    @staticmethod
    def allowed(j):
        """The tokens the job's response_format allows now (a bitmask), or None."""
        return None if j.constraint is None else j.constraint.allowed()

    def last(self, j, n_kv: int) -> bool:
        """Whether the token sampled now is the job's last (max_tokens, or a context of n_kv positions
        that is full: the last sampled token is not run, as in Model.stream)."""
        return (j.max_tokens is not None and len(j.generated) + 1 >= j.max_tokens) or n_kv >= self.n_ctx

    def sample(self, j, row, n_kv: int) -> tuple:
        """The job's next token from one row of a batched step's logits (its KV holds n_kv positions)."""
        return self.stage(j).step(row, self.allowed(j), self.last(j, n_kv))

    # ---- what comes out ------------------------------------------------------------------------------------
    def deliver(self, j, result: tuple, now: float) -> bool:
        """Hands one token's result (token, end, text, logprobs) to the job's sink. True when the job has
        ended (its done or error event sent); else its token runs next."""
        tok, end, text, lp = result
        if j.t_first is None:
            j.t_first = now
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
                    self.fail(j, f"response_format: {j.constraint.error()}")
                    return True
                if end != "stop" and j.constraint.done():  # the grammar is complete
                    text += j.output.flush() if end is None else ""
                    end = "stop"
        lps = [] if lp is None else [(tok, lp[0], lp[1])]
        if end is not None:
            self.finish(j, end, text, lps)
            return True
        if text or lps:
            j.sink({"type": "delta", "index": j.index, "text": text, "logprobs": lps})
        return False

    @staticmethod
    def finish(j, reason: str, text: str = "", lps: list | None = None) -> None:
        if text or lps:
            j.sink({"type": "delta", "index": j.index, "text": text, "logprobs": lps or []})
        j.sink({"type": "done", "index": j.index, "finish_reason": reason, "prompt_tokens": len(j.prompt),
                "completion_tokens": len(j.generated), "cached_tokens": j.cached, "t_start": j.t_start,
                "t_first": j.t_first, "t_end": j.t_last})

    @staticmethod
    def fail(j, message: str) -> None:
        j.sink({"type": "error", "index": j.index, "message": message})
