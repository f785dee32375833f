"""What hf_config (dense models) and moe (mixtures of experts) share: the checks on config.json values
and the record of one output tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import ConvertError


def get_value(cfg: dict, path: str, key: str, default=None, kind=None):
    """cfg[key] (else default), refused when missing or, with kind int/float, not a positive number."""
    v = cfg.get(key, default)
    if v is None:
        raise ConvertError(f"{path}: {key} is missing")
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise ConvertError(f"{path}: {key} = {v!r} is not a positive integer")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ConvertError(f"{path}: {key} = {v!r} is not a positive number")
    return v


@dataclass
class TensorPlan:
    """One output tensor: its GGUF name, the HF tensor it comes from, the expected HF shape, and the
    head count to permute q/k rows with (0 = no permutation); add_one: Gemma's RMSNorm scales by
    (1 + w), stored as 1 + w (computed in the checkpoint's precision, as llama.cpp does).
    parts: a mixture of experts' per-expert HF tensors (each of `shape`; source is the first), stacked
    along a new first axis into one 3-D tensor as llama.cpp stacks them; out_shape: the GGUF tensor's
    shape (numpy order) where it is not the HF one (a [1, n] gate written as [n]).
    build: computes the GGUF tensor from the loaded source and `inputs` (more HF tensors, as (name, shape)
    pairs), in that order: gpt-oss's fused and MXFP4 experts. raw: the ggml type id of the bytes build
    returns (copied as they are, the sources then uint8), where build does not return float32 values."""
    name: str
    source: str
    shape: tuple
    permute_heads: int = 0
    add_one: bool = False
    parts: tuple = ()
    out_shape: tuple | None = None
    inputs: tuple = ()
    build: Callable | None = None
    raw: int | None = None

    @property
    def sources(self) -> tuple:
        return self.parts or (self.source,) + tuple(n for n, _ in self.inputs)

    @property
    def expected(self) -> tuple:
        """(HF name, shape) of every tensor this one is made from."""
        return tuple((s, self.shape) for s in self.parts or (self.source,)) + tuple(self.inputs)

    @property
    def gguf_shape(self) -> tuple:
        if self.out_shape is not None:
            return tuple(self.out_shape)
        return (len(self.parts), *self.shape) if self.parts else tuple(self.shape)
