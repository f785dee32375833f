"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalties; stop strings.

The chain follows llama.cpp's default order::

    penalties -> top-k -> top-p -> min-p -> temperature -> softmax -> draw

so top-p and min-p judge the distribution at temperature 1; the temperature then reshapes only the
probabilities of the survivors. ``temperature <= 0`` is greedy: penalties, then argmax (ties go to the
lowest token id). A fixed ``seed`` makes draws reproducible (same seed, logits and accepted tokens =
same tokens, on every platform); ``seed=RANDOM_SEED`` (the default, 0xFFFFFFFF as in llama.cpp) draws
a fresh seed at construction and at every ``reset()``; ``Sampler.seed`` tells which.

Logits: ``-inf`` marks a token that must never be chosen. NaN or ``+inf`` (also after penalties), a row
of only ``-inf``, or a row of the wrong length raise :class:`optiml.ArgumentError`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence, Tuple, Union

import numpy as np

from .. import _core
from .._core import ArgumentError

__all__ = ["RANDOM_SEED", "Sampler", "SamplingParams", "find_stop", "find_stop_ex"]

RANDOM_SEED: int = _core.SAMPLING_RANDOM_SEED


@dataclass
class SamplingParams:
    """Sampling settings (llama.cpp defaults). See the module docstring for the chain."""

    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off; 0: the likeliest token alone
    min_p: float = 0.05  # <= 0: off; must be <= 1
    repeat_penalty: float = 1.0  # 1: off; > 0. logit > 0 ? logit / penalty : logit * penalty
    repeat_last_n: int = 64  # window of accepted tokens the penalties see (0: off, -1: all)
    frequency_penalty: float = 0.0  # logit -= count * frequency_penalty
    presence_penalty: float = 0.0  # logit -= (count > 0) * presence_penalty
    seed: int = RANDOM_SEED  # RANDOM_SEED: a fresh random seed; anything else: reproducible


def _as_int(name: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ArgumentError(f"{name} must be an integer, not {type(v).__name__}")
    return int(v)


class Sampler:
    """Draws token ids from logits. Not thread-safe: use one per sequence.

    ``Sampler(n_vocab, params)`` or ``Sampler(n_vocab, temperature=0.7, top_k=20, seed=1)``; keywords
    override fields of ``params``.
    """

    def __init__(self, n_vocab: int, params: SamplingParams | None = None, **kwargs):
        fields = asdict(params if params is not None else SamplingParams())
        unknown = set(kwargs) - set(fields)
        if unknown:
            raise ArgumentError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        fields.update(kwargs)
        for name in ("top_k", "repeat_last_n", "seed"):
            fields[name] = _as_int(name, fields[name])
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
            v = fields[name]
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ArgumentError(f"{name} must be a number, got {v!r}")
        if not 0 <= fields["seed"] < 2**64:
            raise ArgumentError(f"seed must be in [0, 2**64), got {fields['seed']}")
        for name in ("top_k", "repeat_last_n"):
            if not -(2**31) <= fields[name] < 2**31:
                raise ArgumentError(f"{name} is out of the int32 range: {fields[name]}")
        n_vocab = _as_int("n_vocab", n_vocab)
        if not 0 < n_vocab < 2**31:
            raise ArgumentError(f"n_vocab must be in [1, 2**31), got {n_vocab}")
        self.params = SamplingParams(**fields)
        self._s = _core.Sampler(n_vocab, **fields)

    @property
    def n_vocab(self) -> int:
        return self._s.n_vocab

    @property
    def seed(self) -> int:
        """The seed in use (the drawn one when the params asked for RANDOM_SEED)."""
        return self._s.seed

    @property
    def penalty_window(self) -> list:
        """Accepted tokens the penalties currently look at, oldest first."""
        return self._s.penalty_window

    def _logits(self, logits) -> np.ndarray:
        a = np.ascontiguousarray(logits, dtype=np.float32)
        if a.ndim != 1:
            raise ArgumentError(f"logits must be one row (1-D), got shape {a.shape}")
        return a

    def sample(self, logits) -> int:
        """Applies the chain to one row of logits and draws a token. Does not record it: see accept()."""
        return self._s.sample(self._logits(logits))

    def accept(self, token: Union[int, Iterable[int]]) -> None:
        """Records a token, or a sequence of them (a prompt), for the penalties."""
        if isinstance(token, (int, np.integer)) and not isinstance(token, (bool, np.bool_)):
            self._s.accept(int(token))
            return
        arr = np.asarray(token)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise ArgumentError("accept() takes a token id or a 1-D sequence of token ids")
        if arr.size and (arr.min() < 0 or arr.max() >= self.n_vocab):
            bad = arr[(arr < 0) | (arr >= self.n_vocab)][0]
            raise ArgumentError(f"token {int(bad)} is out of range for a vocabulary of {self.n_vocab}")
        self._s.accept_many(np.ascontiguousarray(arr, dtype=np.int32))

    def reset(self) -> None:
        """Forgets accepted tokens and re-seeds (a fixed seed replays the same draws)."""
        self._s.reset()

    def probs(self, logits) -> Tuple[np.ndarray, np.ndarray]:
        """(token ids int32, probabilities float64) that sample() would draw from, most likely first."""
        return self._s.probs(self._logits(logits))


def find_stop(text: Union[str, bytes], stops: Sequence[Union[str, bytes]], start: int = 0) -> Tuple[int, int]:
    """Where generation should stop, and what may be streamed out yet.

    Returns ``(index, hold_back)``: ``index`` is the position of the earliest occurrence of any stop at
    or after ``start`` (-1 if none); with no match, the last ``hold_back`` units of ``text`` might begin
    a stop string (or, for bytes, an unfinished UTF-8 character) and must wait for more text; with a
    match ``hold_back`` is 0 (emit ``text[:index]`` and stop). Units are characters for ``str`` and
    bytes for ``bytes`` (stops then must be bytes too; matching itself is on UTF-8 bytes either way).
    Use :func:`find_stop_ex` to also learn which stop matched.
    """
    index, _, hold = find_stop_ex(text, stops, start)
    return index, hold


def find_stop_ex(text: Union[str, bytes], stops: Sequence[Union[str, bytes]], start: int = 0):
    """Like :func:`find_stop`, returning ``(index, which_stop or -1, hold_back)``."""
    if isinstance(stops, (str, bytes)):
        stops = [stops]
    start = _as_int("start", start)
    if isinstance(text, str):
        if not all(isinstance(s, str) for s in stops):
            raise ArgumentError("with str text, stops must be str")
        if not 0 <= start <= len(text):
            raise ArgumentError(f"start ({start}) must be in [0, {len(text)}]")
        tb = text.encode("utf-8", "surrogatepass")
        from_b = len(text[:start].encode("utf-8", "surrogatepass"))
        pos, which, hold = _core.find_stop(tb, [s.encode("utf-8", "surrogatepass") for s in stops], from_b)
        # Byte offsets back to characters; both cuts lie on character boundaries of valid UTF-8.
        if pos >= 0:
            pos = len(tb[:pos].decode("utf-8", "surrogatepass"))
        hold = len(tb[len(tb) - hold :].decode("utf-8", "surrogatepass")) if hold else 0
        return pos, which, hold
    if isinstance(text, (bytes, bytearray, memoryview)):
        if not all(isinstance(s, (bytes, bytearray, memoryview)) for s in stops):
            raise ArgumentError("with bytes text, stops must be bytes")
        return _core.find_stop(bytes(text), [bytes(s) for s in stops], start)
    raise ArgumentError(f"text must be str or bytes, not {type(text).__name__}")
