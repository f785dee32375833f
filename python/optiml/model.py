"""optiml.Model: load a GGUF model and run it (tokenize, eval, generate, stream).

    with optiml.Model("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048) as m:
        print(m.generate("The capital of France is", max_tokens=32, temperature=0))
        for piece in m.stream("Once upon a time", max_tokens=64, seed=1):
            print(piece, end="", flush=True)

The forward pass, tokenizer and sampler are native (optiml._core); this module only orchestrates.
A Model is not thread-safe: it holds one context (KV cache). Use one Model per thread; using one
Model from two threads at once raises OptimlError instead of corrupting the context.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import _core
from ._core import ArgumentError, ContextOverflowError, OptimlError
from .sampling import RANDOM_SEED, Sampler, SamplingParams, find_stop
from .tokenizer import Tokenizer

__all__ = ["Model"]


class Model:
    """A llama-family GGUF model (llama, mistral, qwen2) with one context.

    path: the GGUF file. n_ctx: context length in tokens (default: the model's training context,
    at most 4096). n_threads: CPU threads (default: the physical cores). n_batch: tokens per forward
    pass while reading a prompt. kv_type: "f16" (as llama.cpp) or "f32".
    """

    def __init__(
        self,
        path: str | os.PathLike,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_type: str = "f16",
    ):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"model file not found: {self.path}")
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"expected a GGUF file, got a directory: {self.path}")
        self._model = _core.Model(self.path)
        self.hparams: dict = self._model.hparams
        if n_ctx is None:
            n_ctx = min(self.hparams["n_ctx_train"], 4096)
        n_ctx = _positive_int("n_ctx", n_ctx)
        n_threads = 0 if n_threads is None else _non_negative_int("n_threads", n_threads)
        n_batch = _positive_int("n_batch", n_batch)
        self.tokenizer = Tokenizer.from_file(self.path)
        self._session = _core.Session(self._model, n_ctx, n_threads, kv_type, n_batch)
        self._tokens: list[int] = []  # what the context (KV cache) holds
        self._busy = threading.Lock()

    # ---- properties ---------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self._session.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.hparams["n_vocab"]

    @property
    def n_past(self) -> int:
        """Tokens in the context now."""
        return self._session.n_past

    @property
    def tokens(self) -> list[int]:
        """The token ids in the context, oldest first."""
        return list(self._tokens)

    # ---- text <-> tokens ------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``. add_bos: add the BOS/EOS tokens the model's tokenizer asks for
        (none for SmolLM2). special: text such as "<|im_start|>" becomes that control token."""
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(ids)

    # ---- the context ----------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Appends ``tokens`` to the context and runs them. Returns the logits (float32) of the last
        token, shape (n_vocab,), or of every token, shape (len(tokens), n_vocab)."""
        ids = _token_array(tokens, self.n_vocab)
        with self._exclusive():
            logits = self._session.eval(ids, bool(all_logits))
            self._tokens.extend(int(t) for t in ids)
        return logits

    def reset(self) -> None:
        """Empties the context."""
        with self._exclusive():
            self._session.truncate(0)
            self._tokens.clear()

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, **kwargs) -> str:
        """The text generated after ``prompt`` (a string, or token ids). Keywords as :meth:`stream`."""
        return "".join(self.stream(prompt, max_tokens=max_tokens, **kwargs))

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[str]:
        """Yields the generated text piece by piece as tokens decode (always whole UTF-8 characters).

        Generation ends at an end-of-generation token, at the first stop string (not included in the
        output), after max_tokens tokens, or when the context is full. The context is replaced by
        the prompt and the generated tokens; a prompt that starts like the current context reuses
        its cached part. temperature <= 0 is greedy; seed (None = random) makes sampling repeatable.
        Sampling parameters are llama.cpp's (see optiml.sampling).
        """
        max_tokens = _non_negative_int("max_tokens", max_tokens)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ArgumentError("stop strings must be non-empty str")
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            seed=RANDOM_SEED if seed is None else seed,
        )
        sampler = Sampler(self.n_vocab, params)  # validates the parameters before any work
        ids = self.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ArgumentError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx} (n_ctx), leaving no room to generate"
            )
        return self._stream(ids, max_tokens, sampler, stops)

    def _stream(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str]) -> Iterator[str]:
        with self._exclusive():
            logits = self._start(ids)
            sampler.accept(ids)
            detok = self.tokenizer.detokenizer()
            pending = ""  # decoded text not yet yielded (it may begin a stop string)
            for i in range(max_tokens):
                tok = sampler.sample(logits)
                if self.tokenizer.is_eog(tok):
                    break
                sampler.accept(tok)
                pending += detok.push(tok)
                if stops:
                    at, hold = find_stop(pending, stops)
                    if at >= 0:
                        if at:
                            yield pending[:at]
                        return
                    out, pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
                else:
                    out, pending = pending, ""
                if out:
                    yield out
                if i + 1 == max_tokens or self._session.n_past >= self.n_ctx:
                    break  # the last sampled token is not run: the context ends before it
                logits = self._session.eval(np.array([tok], np.int32), False)
                self._tokens.append(tok)
            pending += detok.flush()
            if pending:
                yield pending

    def _start(self, ids: list[int]) -> np.ndarray:
        """Puts ``ids`` in the context, reusing the longest cached prefix; returns the last logits."""
        common = 0
        for a, b in zip(self._tokens, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1, self._session.n_past)  # the last prompt token must run
        self._session.truncate(common)
        del self._tokens[common:]
        logits = self._session.eval(np.array(ids[common:], np.int32), False)
        self._tokens.extend(ids[common:])
        return logits

    # ---- lifetime -------------------------------------------------------------------------------
    @contextmanager
    def _exclusive(self):
        if self._session is None:
            raise OptimlError(f"{self.path}: the model is closed")
        if not self._busy.acquire(blocking=False):
            raise OptimlError("this Model is in use by another thread (or an unfinished stream); use one Model per thread")
        try:
            yield
        finally:
            self._busy.release()

    def close(self) -> None:
        """Frees the context and unmaps the model (the object is unusable afterwards)."""
        self._session = None
        self._model = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hp = self.hparams
        return (
            f"<optiml.Model {os.path.basename(self.path)!r} {hp['arch']} {hp['n_layer']} layers, "
            f"n_embd {hp['n_embd']}, n_ctx {self.n_ctx if self._session else 'closed'}>"
        )


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ArgumentError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _non_negative_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ArgumentError(f"{name} must be a non-negative integer, got {v!r}")
    return int(v)


def _token_array(tokens, n_vocab: int) -> np.ndarray:
    a = np.asarray(tokens)
    if a.ndim != 1 or a.size == 0:
        raise ArgumentError("tokens must be a non-empty 1-D sequence of token ids")
    if a.dtype.kind not in "iu":
        raise ArgumentError(f"token ids must be integers, not {a.dtype}")
    if a.min() < 0 or a.max() >= n_vocab:
        raise ArgumentError(f"token ids must be in [0, {n_vocab}), got {int(a.min())}..{int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int32)
