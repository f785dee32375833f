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
from .checks import INT_MAX, boolean, non_negative_int

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
        """Adds one token of sequence ``seq`` at position ``pos``; logits: whether decode returns its logits.
        Each is checked here (the native decode takes 32-bit integers), so a bad value names itself."""
        token, seq, pos = non_negative_int("token", token), non_negative_int("seq", seq), non_negative_int("pos", pos)
        logits = boolean("logits", logits)
        self.tokens.append(token)
        self.seq.append(seq)
        self.pos.append(pos)
        self.logits.append(logits)
        return self

    def add_sequence(self, tokens: Sequence[int], seq: int, pos: int = 0, logits: str = "last") -> "Batch":
        """Adds tokens of sequence `seq` at positions pos, pos+1, ...; logits: "last", "all" or "none".
        Nothing is added when any of them is refused."""
        if not isinstance(logits, str) or logits not in ("last", "all", "none"):
            raise ArgumentError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
        if isinstance(tokens, (str, bytes)):  # (its characters or bytes are not token ids)
            raise ArgumentError(f"tokens must be a sequence of token ids, not {type(tokens).__name__}")
        seq, pos = non_negative_int("seq", seq), non_negative_int("pos", pos)
        ids = [non_negative_int("token", t) for t in tokens]
        if ids and pos + len(ids) - 1 > INT_MAX:
            raise ArgumentError(f"the positions pos .. pos + len(tokens) - 1 must be at most {INT_MAX}, got "
                                f"{pos} .. {pos + len(ids) - 1}")
        n = len(ids)
        self.tokens.extend(ids)
        self.seq.extend([seq] * n)
        self.pos.extend(range(pos, pos + n))
        self.logits.extend(logits == "all" or (logits == "last" and i == n - 1) for i in range(n))
        return self

    def clear(self) -> None:
        """Empties the batch (for the next step)."""
        self.tokens.clear()
        self.seq.clear()
        self.pos.clear()
        self.logits.clear()

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        seqs = sorted(set(self.seq))
        which = f"sequence(s) {seqs}" if len(seqs) <= 8 else f"{len(seqs)} sequences"
        return f"<optiml.Batch {len(self.tokens)} token(s) of {which}, {sum(self.logits)} with logits>"

    def arrays(self):
        """(tokens, seq, pos, logits) as contiguous numpy arrays for the native decode."""
        if not self.tokens:
            raise ArgumentError("the batch is empty")
        return (np.asarray(self.tokens, np.int32), np.asarray(self.seq, np.int32), np.asarray(self.pos, np.int32),
                np.asarray(self.logits, np.uint8))
