"""The byte-level BPE pre-tokenizers the converter knows: one table from how tokenizer.json describes
the pre-tokenizer to the name llama.cpp reads from tokenizer.ggml.pre, with the splitting llama.cpp
does for that name. The names are llama.cpp's (src/llama-vocab.cpp, llama_vocab::impl::load): a name
llama.cpp does not know makes it refuse the file ("unknown pre-tokenizer type"), so a name goes into
this table only with its llama.cpp spelling. llama.cpp's own converter recognizes a tokenizer by
hashing the tokens of a test text; matching the pre-tokenizer's structure instead finds the same
family without the tokenizers package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import ConvertError

# The split every GPT-2 style byte-level BPE does (tokenizers' ByteLevel with use_regex=True, and
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2).
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# Split regexes as tokenizer.json spells them ...
LLAMA3_HF_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_HF_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# OpenAI's o200k (gpt-4o, gpt-oss): words split at case changes, a contraction ends a word, "/" after a line break.
_O200K_WORD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_HF_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _O200K_WORD +
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _O200K_WORD +
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ... and as llama.cpp runs them: the same, with the case-insensitive group spelled out (its regex
# engine has no (?i:...)).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_RE = _CONTRACTIONS + LLAMA3_HF_RE[len("(?i:'s|'t|'re|'ve|'m|'ll|'d)"):]
QWEN2_RE = _CONTRACTIONS + QWEN2_HF_RE[len("(?i:'s|'t|'re|'ve|'m|'ll|'d)"):]


@dataclass(frozen=True)
class PreTokenizer:
    name: str  # tokenizer.ggml.pre, spelled as llama.cpp spells it
    steps: tuple  # tokenizer.json's pre_tokenizer, as hf_steps() normalizes it
    regexes: tuple  # what llama.cpp splits the text with for this name, one regex after the other
    what: str  # for messages


PRE_TOKENIZERS = (
    PreTokenizer("gpt-2", (("ByteLevel", "regex"),), (GPT2_RE,), "GPT-2 byte level"),
    PreTokenizer("smollm", (("Digits", "each"), ("ByteLevel", "regex")), (r"\p{N}", GPT2_RE),
                 "SmolLM/StarCoder (each digit alone, then GPT-2's split)"),
    PreTokenizer("llama-bpe", (("Split", LLAMA3_HF_RE), ("ByteLevel", "bytes")), (LLAMA3_RE,), "Llama 3"),
    PreTokenizer("qwen2", (("Split", QWEN2_HF_RE), ("ByteLevel", "bytes")), (QWEN2_RE,), "Qwen2"),
    # llama.cpp runs o200k with ASCII stand-ins for the letter classes (its std::regex has no \p{Lu});
    # OptiML's pre-tokenizer runs the classes themselves, as tokenizer.json does.
    PreTokenizer("gpt-4o", (("Split", GPT4O_HF_RE), ("ByteLevel", "bytes")), (GPT4O_HF_RE,), "OpenAI o200k"),
)
BY_NAME = {p.name: p for p in PRE_TOKENIZERS}


def hf_steps(pre) -> tuple:
    """tokenizer.json's pre_tokenizer (one step or a Sequence) as a tuple of (kind, detail) steps;
    what no entry can match (an unknown kind, a prefix space, a Split that is not Isolated) keeps its
    JSON so that it matches nothing."""
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        pre = pre.get("pretokenizers") or []
    out = []
    for s in pre if isinstance(pre, list) else [pre]:
        kind = s.get("type") if isinstance(s, dict) else None
        if kind == "ByteLevel" and not s.get("add_prefix_space", False):
            out.append(("ByteLevel", "regex" if s.get("use_regex", True) else "bytes"))
        elif kind == "Digits":
            out.append(("Digits", "each" if s.get("individual_digits") else "runs"))
        elif (kind == "Split" and isinstance(s.get("pattern"), dict) and "Regex" in s["pattern"]
              and s.get("behavior") == "Isolated" and not s.get("invert", False)):
            out.append(("Split", s["pattern"]["Regex"]))
        else:
            out.append((str(kind), json.dumps(s, sort_keys=True)))
    return tuple(out)


def find(pre, path: str) -> PreTokenizer:
    """The table's entry for a tokenizer.json pre_tokenizer; ConvertError when none matches."""
    steps = hf_steps(pre)
    for p in PRE_TOKENIZERS:
        if p.steps == steps:
            return p
    known = "; ".join(f"{p.what} ({p.name})" for p in PRE_TOKENIZERS)
    raise ConvertError(f"{path}: pre-tokenizer {json.dumps(pre)[:200]} is not one OptiML knows; supported: {known}")
