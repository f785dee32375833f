"""Embeddings: each text's final hidden states (after the output norm, as llama.cpp's) pooled into one vector.

Pooling as llama.cpp names it: "mean" over the tokens, "cls" the first token's, "last" the last token's (what
Qwen3-Embedding and other decoder embedding models use), "none" every token's. The default is the file's
`{arch}.pooling_type`, else mean. normalize: each vector divided by its Euclidean norm (what OpenAI's and
llama-server's /v1/embeddings return).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._core import ArgumentError

POOLINGS = ("mean", "cls", "last", "none")


def choose_pooling(pooling: str | None, hparams: dict) -> str:
    """The pooling to use: the caller's, else the file's, else mean; rank (rerankers) is refused."""
    if pooling is None:
        pooling = hparams.get("pooling") or "mean"
        if pooling == "rank":
            raise ArgumentError("this file is a reranker (pooling_type rank), which OptiML does not run; give pooling= "
                                "to embed with one of " + ", ".join(POOLINGS))
    if pooling not in POOLINGS:
        raise ArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    return pooling


def pool(hidden: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """[n_tokens, n_embd] hidden states -> one vector (or every token's, for "none"), float32."""
    if pooling == "mean":
        v = hidden.astype(np.float64).mean(axis=0)
    elif pooling == "cls":
        v = hidden[0].astype(np.float64)
    elif pooling == "last":
        v = hidden[-1].astype(np.float64)
    else:
        v = hidden.astype(np.float64)
    if normalize:
        norm = np.linalg.norm(v, axis=-1, keepdims=True)
        v = np.divide(v, norm, out=np.zeros_like(v), where=norm > 0)
    return v.astype(np.float32)


def inputs(input) -> tuple[list, bool]:
    """A text, token ids (a list or a 1-D array), or a list of either (or a 2-D array) -> (the list, whether one
    was given alone)."""
    if isinstance(input, np.ndarray):
        if input.ndim == 1:
            return [input.tolist()], True
        input = list(input.tolist()) if input.ndim == 2 else input  # (other shapes: refused below)
    if isinstance(input, (str, bytes)):
        return [input], True
    if isinstance(input, Sequence) and input and all(isinstance(t, (int, np.integer)) for t in input):
        return [list(input)], True
    if isinstance(input, Sequence) and input and all(isinstance(t, (str, bytes, Sequence)) for t in input):
        return list(input), False
    raise ArgumentError("input must be a text, a list of token ids, or a non-empty list of texts or of token id lists")
