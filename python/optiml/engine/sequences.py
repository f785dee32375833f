"""Model's multi-sequence API, which the server builds on: decode an optiml.Batch (every sequence in it
advances, sharing each weight read), step one sequence natively, and manage the KV cache's sequences (copy a
shared prompt, truncate, clear, move between host and device memory).

Sequences is mixed into Model: it uses the model's native session (_session), its lock (_exclusive) and
_forget_seq0 (sequence 0 is also the context of generate and chat, whose cached prompt a change outside
them must invalidate).
"""

from __future__ import annotations

import numpy as np

from .. import _core
from .._core import ArgumentError
from .batch import Batch
from .checks import non_negative_int

__all__ = ["Sequences"]


class Sequences:
    """decode, seq_len and the kv_* methods of optiml.Model (see the module doc)."""

    @property
    def n_seq(self) -> int:
        """Sequence slots of the KV cache."""
        return self._session.n_seq

    def decode(self, batch) -> np.ndarray:
        """Runs one step over ``batch`` (optiml.Batch): every sequence in it advances, sharing each weight
        read. Returns float32 logits [tokens that want them, n_vocab] in batch order. Decoding into
        sequence 0 forgets the cached prompt that generate/chat would reuse."""
        if not isinstance(batch, Batch):
            raise TypeError(f"decode takes an optiml.Batch (tokens with their sequences and positions), not "
                            f"{type(batch).__name__}; to run token ids in the context use eval")
        tokens, seq, pos, want = batch.arrays()
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ArgumentError(f"token ids must be in [0, {self.n_vocab}), got {int(tokens.min())}..{int(tokens.max())}")
        with self._exclusive():
            if (seq == 0).any():
                self._forget_seq0()
            return self._session.decode(tokens, seq, pos, want)

    def _step_sequence(self, seq: int, pos: int, token: int, output, allowed, last: bool) -> tuple:
        """One token of sequence ``seq`` run and taken through its output stage (engine.generation.output_stage)
        in one native call, the GIL released (optiml._core.step_sequence): the server, while a request runs
        alone. ``allowed``: the allowed-token bitmask or None; ``last``: the token sampled now is the last.
        Returns what ``output.step`` does: (token or -1, end, text out, logprobs)."""
        with self._exclusive():
            if seq == 0:
                self._forget_seq0()
            return _core.step_sequence(self._session, seq, pos, token, output, allowed, last)

    def seq_len(self, seq: int) -> int:
        """Positions held by sequence ``seq``."""
        return self._session.seq_len(non_negative_int("seq", seq))

    def kv_clear(self, seq: int | None = None) -> None:
        """Forgets sequence ``seq`` (every sequence when None)."""
        with self._exclusive():
            self._session.kv_clear(-1 if seq is None else non_negative_int("seq", seq))
            if seq is None or seq == 0:
                self._forget_seq0()

    def kv_truncate(self, seq: int, n: int) -> None:
        """Keeps the first ``n`` positions of sequence ``seq``."""
        with self._exclusive():
            seq, n = non_negative_int("seq", seq), non_negative_int("n", n)
            if seq == 0:  # first: a Ctrl-C between the two leaves fewer ids known, never stale ones
                del self._tokens[n:]
                self._chat.forget()
            self._session.kv_truncate(seq, n)

    def kv_copy(self, src: int, dst: int, n: int | None = None) -> None:
        """Sequence ``dst`` becomes the first ``n`` positions of ``src`` (all of them when None): a shared
        prompt is run once and copied to every sequence that continues it."""
        with self._exclusive():
            self._session.kv_copy(non_negative_int("src", src), non_negative_int("dst", dst),
                                  -1 if n is None else non_negative_int("n", n))
            if dst == 0:
                self._forget_seq0()

    def kv_place(self, seq: int, where: str) -> None:
        """CPU attention offload: moves sequence ``seq``'s KV cache to host memory (``where="host"``) or
        back to the device (``"device"``). From the next decode on, the host computes that sequence's
        attention while the device runs the linear layers, the batch split in two sub-batches so that
        both work at once (NEO). Needs a device holding every layer's attention (e.g.
        ``device="cuda"``, or ``"cpu:1"`` with enough ``vram``); the tokens and logits are the same
        wherever a sequence lives."""
        if where not in ("host", "device"):  # a device slot must be free to move a sequence back
            raise ArgumentError(f"where must be 'host' or 'device', not {where!r}")
        with self._exclusive():
            self._session.kv_place(non_negative_int("seq", seq), where == "host")

    def kv_where(self, seq: int) -> str:
        """Where sequence ``seq``'s KV cache lives: "device" (for a CPU-only plan: with the rest) or
        "host" (moved by :meth:`kv_place`, or beyond what ``kv_vram`` holds on the device)."""
        return "host" if self._session.kv_on_host(non_negative_int("seq", seq)) else "device"
