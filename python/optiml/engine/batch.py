"""optiml.Batch: tokens of several sequences for one step of Model.decode, as llama.cpp's llama_batch.

    b = optiml.Batch()
    for s, prompt in enumerate(prompts):
        b.add_sequence(prompt, seq=s)              # positions 0.. of sequence s, logits of the last token
    logits = m.decode(b)                           # [tokens that want logits, n_vocab], in batch order
    b.clear(); b.add(next_token, seq=0, pos=len(prompts[0]))
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .._core import ArgumentError

__all__ = ["Batch"]


class Batch:
    """Tokens, each with (sequence id, position, wants logits). Each sequence's tokens have consecutive
    positions starting at most at the sequence's current length (Model.seq_len); a start below it
    forgets what followed."""

    def __init__(self):
        self.tokens: list[int] = []
        self.seq: list[int] = []
        self.pos: list[int] = []
        self.logits: list[bool] = []

    def add(self, token: int, seq: int, pos: int, logits: bool = False) -> "Batch":
        for name, v in (("token", token), ("seq", seq), ("pos", pos)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ArgumentError(f"{name} must be a non-negative integer, not {v!r}")
        self.tokens.append(int(token))
        self.seq.append(int(seq))
        self.pos.append(int(pos))
        self.logits.append(bool(logits))
        return self

    def add_sequence(self, tokens: Sequence[int], seq: int, pos: int = 0, logits: str = "last") -> "Batch":
        """Adds tokens of sequence `seq` at positions pos, pos+1, ...; logits: "last", "all" or "none"."""
        if logits not in ("last", "all", "none"):
            raise ArgumentError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
        tokens = list(tokens)
        for i, t in enumerate(tokens):
            self.add(t, seq, pos + i, logits == "all" or (logits == "last" and i == len(tokens) - 1))
        return self

    def clear(self) -> None:
        self.tokens.clear()
        self.seq.clear()
        self.pos.clear()
        self.logits.clear()

    def __len__(self) -> int:
        return len(self.tokens)

    def arrays(self):
        """(tokens, seq, pos, logits) as contiguous numpy arrays for the native decode."""
        if not self.tokens:
            raise ArgumentError("the batch is empty")
        return (np.asarray(self.tokens, np.int32), np.asarray(self.seq, np.int32), np.asarray(self.pos, np.int32),
                np.asarray(self.logits, np.uint8))
