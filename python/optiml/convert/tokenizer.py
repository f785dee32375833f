"""The HF tokenizer as llama.cpp's tokenizer.ggml.* metadata: byte-level BPE from tokenizer.json
("gpt2", with merges; the pre-tokenizer's name from pre_tokenizers.py) or SentencePiece from
tokenizer.model ("llama"), plus special tokens and the chat template from tokenizer_config.json.
Reads the files directly (no transformers/tokenizers needed at conversion time)."""

from __future__ import annotations

import json
import os

from . import pre_tokenizers, sentencepiece_model
from .errors import ConvertError

# gguf token types (llama.cpp's llama_token_type; SentencePiece uses the same numbers)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            v = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    except RecursionError:  # (json recurses once per level: "[" * 100000 is a corrupt file, not a crash)
        raise ConvertError(f"{path}: cannot read: JSON nested too deeply (a corrupt file? download it again)") from None
    if not isinstance(v, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return v


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None


def _pre_tokenizer_name(pre, path: str) -> str:
    """llama.cpp's tokenizer.ggml.pre for a tokenizer.json pre_tokenizer structure."""
    return pre_tokenizers.find(pre, path).name


def _looks_special(text: str) -> bool:
    """llama.cpp also marks added tokens shaped like control tokens as control (does_token_look_special)."""
    return ((text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))
            or text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]"))


def _content(entry):
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _bpe_vocab(tj: dict, n_vocab: int, path: str) -> dict:
    model = tj.get("model") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ConvertError(f"{path}: model.vocab is missing")
    bad = next((t for t, i in vocab.items() if type(i) is not int or i < 0), None)
    if bad is not None:
        raise ConvertError(f"{path}: model.vocab gives token {bad!r} the id {vocab[bad]!r}, not a token id")
    added = tj.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(a, dict) and isinstance(a.get("content"), str)
                                              and type(a.get("id")) is int and a["id"] >= 0 for a in added):
        raise ConvertError(f"{path}: added_tokens is not a list of {{\"id\": token id, \"content\": text}} entries")
    tokens = [None] * n_vocab
    types = [NORMAL] * n_vocab
    for text, i in vocab.items():
        if i < n_vocab:
            tokens[i] = text
    for a in added:
        i = a["id"]
        if i < n_vocab:
            tokens[i] = a["content"]
            types[i] = CONTROL if a.get("special") or _looks_special(a["content"]) else USER_DEFINED
    if max(list(vocab.values()) + [a["id"] for a in added]) >= n_vocab:
        raise ConvertError(f"{path}: the tokenizer has ids past config.json's vocab_size {n_vocab}")
    for i, t in enumerate(tokens):
        if t is None:  # config.json's vocab_size pads past the tokenizer (llama.cpp's [PADn])
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = model.get("merges")
    if not merges:  # (gguf-py writes no empty array, and llama.cpp refuses a gpt2 vocabulary without the key)
        raise ConvertError(f"{path}: model.merges is missing or empty; a byte-level BPE tokenizer without merges "
                           "cannot be written to GGUF")
    if not isinstance(merges, list) or not all(
            isinstance(m, str) or (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m))
            for m in merges):
        raise ConvertError(f"{path}: model.merges is not a list of merges (\"a b\" strings or [a, b] pairs)")
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return {"model": "gpt2", "pre": _pre_tokenizer_name(tj.get("pre_tokenizer"), path),
            "tokens": tokens, "types": types, "merges": merges}


def _spm_vocab(folder: str, n_vocab: int, tc: dict) -> dict:
    path = os.path.join(folder, "tokenizer.model")
    m = sentencepiece_model.load(path)
    if m.model_type != 2:  # llama.cpp's "llama" tokenizer is SentencePiece BPE
        raise ConvertError(f"{path}: SentencePiece model type {m.model_type} is not supported (BPE)")
    tokens = [p.piece for p in m.pieces]
    scores = [p.score for p in m.pieces]
    types = [p.type for p in m.pieces]
    if len(tokens) > n_vocab:
        raise ConvertError(f"{path}: {len(tokens)} pieces, more than config.json's vocab_size {n_vocab}")
    # Tokens added on top (added_tokens_decoder in tokenizer_config.json), as llama.cpp does.
    for sid, info in (tc.get("added_tokens_decoder") or {}).items():
        i = int(sid)
        if not 0 <= i < n_vocab or not isinstance(info, dict):
            continue
        while len(tokens) <= i:
            tokens.append(f"[PAD{len(tokens)}]"), scores.append(-1000.0), types.append(UNUSED)
        tokens[i] = info.get("content", tokens[i])
        types[i] = CONTROL if info.get("special") else USER_DEFINED
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]"), scores.append(-1000.0), types.append(UNUSED)
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types,
            "add_space_prefix": m.add_dummy_prefix,
            "ids": {"bos": m.bos_id, "eos": m.eos_id, "unk": m.unk_id, "pad": m.pad_id}}


def _safe_name(name: str) -> str:
    """A template's name as gguf-py writes it into a key (tokenizer.chat_template.<name>): letters and
    digits kept, anything else "_"."""
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name)


def _chat_templates(folder: str, tc: dict) -> dict:
    """The chat templates by name, "default" the main one, in the order the files give them. As
    transformers loads them: the files chat_template.jinja (the default) and additional_chat_templates/
    NAME.jinja (where transformers 5 saves them), then, without a default file, tokenizer_config.json's
    chat_template, one template or a list of {"name", "template"} (the older form). A name given twice
    keeps its first template."""
    templates = {}

    def add(name: str, template: str) -> None:
        if _safe_name(name):  # (gguf-py skips a template without a name)
            templates.setdefault(_safe_name(name), template)

    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        add("default", _read_text(jinja))
    extra = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra):
        for fn in sorted(os.listdir(extra)):
            if fn.endswith(".jinja") and os.path.isfile(os.path.join(extra, fn)):
                add(fn[:-len(".jinja")], _read_text(os.path.join(extra, fn)))
    if "default" in templates:
        return templates
    t = tc.get("chat_template")  # (named .jinja files without a default one keep the config's as the default)
    if isinstance(t, str):
        add("default", t)
    for x in t if isinstance(t, list) else []:
        if isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("template"), str):
            add(x["name"], x["template"])
    return templates


def load_vocab(folder: str, n_vocab: int, prefer_bpe: bool = False) -> dict:
    """Tokenizer metadata: model, pre, tokens, scores, types, merges, special ids, add_bos/eos,
    add_space_prefix, chat_template (the default one) and chat_templates (the named others: {name:
    template}); keys absent when the files do not say."""
    tj_path = os.path.join(folder, "tokenizer.json")
    tc_path = os.path.join(folder, "tokenizer_config.json")
    tc = _read_json(tc_path) if os.path.isfile(tc_path) else {}
    tj = _read_json(tj_path) if os.path.isfile(tj_path) else None
    tj_model = (tj or {}).get("model") or {}
    # As llama.cpp's llama converter: SentencePiece when tokenizer.model is there, else byte-level BPE.
    if os.path.isfile(os.path.join(folder, "tokenizer.model")) and not prefer_bpe:
        v = _spm_vocab(folder, n_vocab, tc)
    elif tj_model.get("type") == "BPE" and not tj_model.get("byte_fallback"):
        v = _bpe_vocab(tj, n_vocab, tj_path)
        v["ids"] = {}
    elif tj is not None:
        raise ConvertError(f"{tj_path}: tokenizer model {tj_model.get('type')!r} is not supported "
                           "(byte-level BPE in tokenizer.json, or SentencePiece in tokenizer.model)")
    else:
        raise ConvertError(f"{folder}: no tokenizer.json or tokenizer.model")

    # Special tokens: tokenizer_config.json's {bos,eos,unk,pad}_token texts looked up among the tokens.
    index = {t: i for i, t in enumerate(v["tokens"])}
    for typ in ("bos", "eos", "unk", "pad"):
        text = _content(tc.get(f"{typ}_token"))
        if text is not None and text in index:
            v["ids"][typ] = index[text]
    if tj is not None:
        _post_processor_flags(tj.get("post_processor"), v, index)
    for typ in ("bos", "eos"):
        if isinstance(tc.get(f"add_{typ}_token"), bool):
            v[f"add_{typ}"] = tc[f"add_{typ}_token"]
    v["ids"] = {k: i for k, i in v["ids"].items() if isinstance(i, int) and 0 <= i < n_vocab}
    templates = _chat_templates(folder, tc)
    default = templates.pop("default", None)
    if default:
        v["chat_template"] = default
    if templates:  # the named ones: tokenizer.chat_template.<name> each, and tokenizer.chat_templates
        v["chat_templates"] = templates
    return v


def _post_processor_flags(pp, v: dict, index: dict) -> None:
    """add_bos/add_eos from a TemplateProcessing post-processor (Llama 3 says it only there)."""
    if isinstance(pp, dict) and pp.get("type") == "Sequence":
        pp = next((p for p in pp.get("processors") or [] if isinstance(p, dict) and p.get("type") == "TemplateProcessing"),
                  None)
    if not isinstance(pp, dict) or pp.get("type") != "TemplateProcessing":
        return
    single = pp.get("single") or []
    if not isinstance(single, list) or not single or not all(isinstance(x, dict) for x in single):
        return
    first, last = single[0], single[-1]
    if "SpecialToken" in first:
        v["add_bos"] = True
        v["ids"].setdefault("bos", index.get(first["SpecialToken"]["id"]))
    else:
        v["add_bos"] = False
    if "SpecialToken" in last and len(single) > 1:
        v["add_eos"] = True
        v["ids"].setdefault("eos", index.get(last["SpecialToken"]["id"]))
    else:
        v["add_eos"] = False
