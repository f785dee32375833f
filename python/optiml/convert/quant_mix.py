"""Which ggml type each tensor gets for an output type, following llama.cpp (llama_tensor_get_type in
llama-quant.cpp, and convert_hf_to_gguf.py for the float types) so file sizes and quality match."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F

from ..formats import quant
from .errors import ConvertError


@dataclass(frozen=True)
class OutType:
    name: str
    ftype: F  # general.file_type
    base: T  # the type most 2-D weights get
    kquant_mix: bool  # llama-quantize's per-tensor rules apply (every quantized ftype)


TYPES = {t.name: t for t in (
    OutType("f32", F.ALL_F32, T.F32, False),
    OutType("f16", F.MOSTLY_F16, T.F16, False),
    OutType("bf16", F.MOSTLY_BF16, T.BF16, False),
    # q8_0 as convert_hf_to_gguf.py writes it: every matrix Q8_0 (llama-quantize gives the same).
    OutType("q8_0", F.MOSTLY_Q8_0, T.Q8_0, False),
    OutType("q4_0", F.MOSTLY_Q4_0, T.Q4_0, True),
    OutType("q4_1", F.MOSTLY_Q4_1, T.Q4_1, True),
    OutType("q5_0", F.MOSTLY_Q5_0, T.Q5_0, True),
    OutType("q5_1", F.MOSTLY_Q5_1, T.Q5_1, True),
    OutType("q4_k_m", F.MOSTLY_Q4_K_M, T.Q4_K, True),
    OutType("q5_k_m", F.MOSTLY_Q5_K_M, T.Q5_K, True),
    OutType("q6_k", F.MOSTLY_Q6_K, T.Q6_K, True),
    # llama-quantize's IQ4_NL and IQ4_XS without an importance matrix (a non-linear 4-bit table; Q5_K for the first
    # eighth of ffn_down and for attn_v where 4 or more query heads share a KV head)
    OutType("iq4_nl", F.MOSTLY_IQ4_NL, T.IQ4_NL, True),
    OutType("iq4_xs", F.MOSTLY_IQ4_XS, T.IQ4_XS, True),
    # llama-quantize's MXFP4_MOE (gpt-oss's layout): the 3-D expert tensors MXFP4, every other matrix Q8_0.
    OutType("mxfp4_moe", F.MOSTLY_MXFP4_MOE, T.MXFP4, True),
)}


def out_type(name: str) -> OutType:
    t = TYPES.get(str(name).lower())
    if t is None:
        raise ConvertError(f"output type {name!r} is not supported; supported: {', '.join(TYPES)}")
    return t


def _block(t: T) -> int:
    return quant.type_info(int(t)).block_size


def _more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layers that get more bits: the first and last eighth, and every third in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


# What llama.cpp falls back to when a row does not split into blocks of the chosen type.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}


def tensor_type(name: str, shape: tuple, ot: OutType, n_layer: int, has_output: bool, n_expert: int = 0,
                n_gqa: int = 1) -> T:
    """The type of GGUF tensor `name` with numpy shape `shape` ([n_expert,] rows, row length) in a model
    of n_layer layers and n_expert experts (0: dense) whose KV heads serve n_gqa query heads each."""
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith("ffn_gate_inp.weight"):
        return T.F32  # norms, biases, rope factors, 1-D gates; a mixture's router stays F32 at every type
    nx = shape[-1]
    t = ot.base
    if not ot.kquant_mix:
        if t == T.Q8_0 and nx % _block(t):
            return T.F16  # as convert_hf_to_gguf.py does when a row does not split into blocks
        return t

    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    kind = name.split(".")[-2] if layer >= 0 else ""
    k_m = ot.ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M)
    iq4 = ot.ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS)
    if ot.ftype == F.MOSTLY_MXFP4_MOE:  # the output too (llama-quantize as llama-cpp-python 0.3.36 has it)
        t = T.MXFP4 if len(shape) == 3 else T.Q8_0
    elif name == "output.weight" or (not has_output and name == "token_embd.weight"):
        # Q6_K for the output projection (Q8_0 if its rows do not split into the base type's blocks).
        t = T.Q8_0 if nx % _block(t) else (T.Q6_K if t != T.Q8_0 else t)
    elif kind in ("attn_v", "attn_k", "attn_qkv"):  # (llama.cpp counts a fused q/k/v, Phi-3's, as attn_v)
        if kind != "attn_k" and k_m and _more_bits(layer, n_layer):
            t = T.Q6_K
        elif kind != "attn_k" and iq4 and n_gqa >= 4:
            t = T.Q5_K
        if n_expert == 8:  # llama.cpp's rule for Mixtral-8x7B's shape (any model with 8 experts)
            t = T.Q8_0
    elif kind.startswith("ffn_down"):  # ffn_down, ffn_down_exps, ffn_down_shexp
        if k_m and _more_bits(layer, n_layer):
            t = T.Q6_K
        elif iq4 and layer < n_layer // 8:
            t = T.Q5_K
    elif kind == "attn_output" and n_expert == 8 and (ot.ftype == F.MOSTLY_Q4_K_M or iq4):
        t = T.Q5_K
    # A row length that does not split into blocks: llama.cpp's fallback, then F16.
    if nx % _block(t):
        if t not in _FALLBACK:
            raise ConvertError(f"{name}: row length {nx} does not split into {t.name} blocks")
        t = _FALLBACK[t]
        if nx % _block(t):
            t = T.F16
    return t
