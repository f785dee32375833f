"""Generation in one context: stream()'s arguments checked into a sampler, the part of the context a prompt
reuses, the last chat turn kept as token ids, and the native loop (optiml._core.Generator) whose pieces
Model.stream hands on. The loop itself (eval, sampling, detokenization, stop strings) is native; its
per-token part, the output stage (optiml._core.OutputStage), is also what the server takes each
sequence's tokens through (output_stage)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import _core
from .._core import ArgumentError, ContextOverflowError
from .sampling import RANDOM_SEED, Sampler, SamplingParams

__all__ = ["ChatPrefix", "cached_prefix", "check_prompt", "generator", "make_sampler", "output_stage", "stop_strings"]


def make_sampler(n_vocab: int, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
            repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
            presence_penalty: float = 0.0, seed: int | None = None) -> Sampler:
    """A sampler with llama.cpp's parameters (see optiml.sampling); seed None is random. Bad values raise
    ArgumentError here, before any work."""
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
    return Sampler(n_vocab, params)


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """stop as a list of non-empty strings (one string, several, or None for none)."""
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise ArgumentError(f"stop must be a string or a list of strings, not {type(stop).__name__}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ArgumentError("stop strings must be non-empty str")
    return stops


def prompt_ids(prompt, n_vocab: int) -> list[int]:
    """A prompt given as token ids, checked as eval checks them (integers in the vocabulary: 3.7 or True is
    not a token id)."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise ArgumentError(f"the prompt must be text (str or bytes) or a sequence of token ids, not "
                            f"{type(prompt).__name__}")
    ids = list(prompt)
    for t in ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ArgumentError(f"token ids must be integers, got {t!r}")
        if not 0 <= t < n_vocab:
            raise ArgumentError(f"token id {t} is outside the vocabulary (0..{n_vocab - 1})")
    return [int(t) for t in ids]


def check_prompt(ids: list[int], n_ctx: int) -> None:
    """A prompt must have tokens and leave room in the context to generate."""
    if not ids:
        raise ArgumentError("the prompt is empty")
    if len(ids) >= n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(ids)} tokens; the context holds {n_ctx} (n_ctx), leaving no room to generate"
        )


def cached_prefix(context: list[int], ids: list[int], n_past: int) -> int:
    """How many of ``ids`` the context (its token ids, n_past positions) already holds and may keep: the
    longest cached prefix, short of the last prompt token, which must run for its logits."""
    common = 0
    for a, b in zip(context, ids):
        if a != b:
            break
        common += 1
    return min(common, len(ids) - 1, n_past)


def generator(session, tokenizer, sampler: Sampler, ids: list[int], n_cached: int, max_tokens: int,
              stops: list[str]) -> _core.Generator:
    """The native generation loop over ``ids`` (its first n_cached already in the context): iterating it
    yields text pieces, with the GIL released while it works."""
    return _core.Generator(session, tokenizer._t, sampler._s, np.array(ids, np.int32), n_cached, max_tokens,
                           _utf8(stops))


def output_stage(tokenizer, sampler: Sampler, stops: list[str], logit_bias: dict | None = None,
                 top_logprobs: int = -1) -> _core.OutputStage:
    """One sequence's native output stage (native/include/optiml/generate.h), the per-token step of
    Model.generate's loop: ``stage.step(logits, allowed, last)`` adds the logit bias ({token id: value}),
    sets the tokens outside ``allowed`` (a little-endian bitmask, or None) to -inf, samples, and returns
    (token or -1 at end of generation, None / "stop" / "length", the text that may go out, logprobs: None
    or (the token's, [(token, logprob)] of the top_logprobs best; -1: none)). The sampler must already
    have accepted the prompt."""
    bias = logit_bias or {}
    return _core.OutputStage(tokenizer._t, sampler._s, _utf8(stops), np.array(list(bias), np.int32),
                             np.array(list(bias.values()), np.float32), top_logprobs)


def _utf8(stops: list[str]) -> list[bytes]:
    return [s.encode("utf-8", "surrogatepass") for s in stops]


class ChatPrefix:
    """The text of the last chat prompt and answer and its token ids, as the model saw and generated them.
    The next turn's prompt text starts with it (the answer appended, a new user message after): those ids
    are kept and only the rest is tokenized, so the context's cached prefix is reused exactly."""

    def __init__(self):
        self.text = ""
        self.ids: list[int] = []

    def forget(self) -> None:
        self.text, self.ids = "", []

    def remember(self, text: str, ids: list[int]) -> None:
        self.text, self.ids = text, ids

    def ids_for(self, text: str, tokenizer) -> list[int]:
        """The token ids of a rendered chat prompt: the remembered ids when the text begins with their
        text, else the whole text tokenized (with the BOS the model wants: the template does not write it)."""
        if self.text and text.startswith(self.text):
            return self.ids + tokenizer.encode(text[len(self.text):], add_special=False, parse_special=True)
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
        if tokenizer.add_bos and tokenizer.bos_id >= 0 and (not ids or ids[0] != tokenizer.bos_id):
            ids.insert(0, tokenizer.bos_id)
        return ids
