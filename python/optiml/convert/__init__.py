"""Hugging Face checkpoints (config.json + safetensors + tokenizer files) to GGUF, laid out as
llama.cpp's convert_hf_to_gguf.py + llama-quantize would: tensor names, metadata keys, q/k row
permutation, tokenizer fields and the per-tensor quantization mix.

    from optiml.convert import convert
    convert("SmolLM2-135M-Instruct/", "smollm2.q4_k_m.gguf", type="q4_k_m")
"""

from __future__ import annotations

import os
import re
import warnings

import gguf
import numpy as np

from . import hf_config, phi3, quant_mix, tokenizer, writer
from .errors import ConvertError
from .hf_config import SUPPORTED as SUPPORTED_ARCHITECTURES
from .quant_mix import TYPES
from ..util.atomic import check_output_path
from .safetensors import Checkpoint

__all__ = ["ConvertError", "SUPPORTED_ARCHITECTURES", "TYPES", "convert"]

_LAYER_PREFIX = "model.layers."
_LAYER = re.compile(re.escape(_LAYER_PREFIX) + r"([0-9]+)\.")  # (every architecture here names its layers so)


def _add_metadata(w: gguf.GGUFWriter, cfg: hf_config.ModelConfig, ot: quant_mix.OutType, vocab: dict, name: str):
    w.add_name(name)
    w.add_file_type(int(ot.ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    adders = {"u32": w.add_uint32, "f32": w.add_float32, "str": w.add_string}
    for kind, key, value in hf_config.hparams_kv(cfg):
        adders[kind](key, value)

    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    ids = vocab["ids"]
    for typ, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):
        if typ in ids:
            add(ids[typ])
    if "add_bos" in vocab:
        w.add_add_bos_token(vocab["add_bos"])
    if "add_eos" in vocab:
        w.add_add_eos_token(vocab["add_eos"])
    if "add_space_prefix" in vocab:
        w.add_add_space_prefix(vocab["add_space_prefix"])
    if "chat_template" in vocab:
        w.add_chat_template(vocab["chat_template"])
    # The named templates as gguf-py's add_chat_template writes a list of them (llama.cpp's converter),
    # in the files' order where gguf-py's set would make the file differ from run to run.
    named = vocab.get("chat_templates") or {}
    for tname, template in named.items():
        w.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=tname), template)
    if named:
        w.add_array(gguf.Keys.Tokenizer.CHAT_TEMPLATES, list(named))


def _check_not_an_input(hf_dir: str, out: str) -> None:
    """Refuses an output that would replace a file of the checkpoint: inside its folder only GGUF files
    (an earlier conversion's) may be replaced. The output's own name decides where it is, not what a link
    there points to: the output is renamed over that name (a Hugging Face cache's snapshot holds links into
    its blobs)."""
    root = os.path.realpath(hf_dir)
    folder = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if not os.path.lexists(out) or os.path.commonpath([folder, root]) != root:
        return
    try:
        with open(out, "rb") as f:
            if f.read(4) == b"GGUF":
                return
    except OSError:  # (a dangling link, an unreadable file: a file of the folder all the same)
        pass
    raise ConvertError(f"{out}: a file of the checkpoint being converted; the output must be a new file or a "
                       "GGUF file")


def _checked(what: str, load):
    """load(), with a config or tokenizer file of unexpected shape (a wrong type where a checked field has
    none) said as a ConvertError naming the files instead of a Python error from deep inside."""
    try:
        return load()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ConvertError(f"{what}: a value of an unexpected type or shape ({e.__class__.__name__}: {e})") from e


def _special_ids_from_config(vocab: dict, cfg: hf_config.ModelConfig) -> None:
    """BOS, EOS and PAD ids from config.json where the tokenizer files name none (as gguf-py's SpecialVocab
    falls back): without them llama.cpp takes its defaults for the tokenizer model (GPT-2's 11)."""
    for typ in ("bos", "eos", "pad"):
        i = cfg.raw.get(f"{typ}_token_id")
        if typ not in vocab["ids"] and isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.n_vocab:
            vocab["ids"][typ] = i


def _check_sizes(hf_dir: str, cfg: hf_config.ModelConfig, ckpt: Checkpoint) -> None:
    """config.json's layer count and vocabulary size against the checkpoint's tensors, cheaply: the plan
    and the tokenizer's tables are built for them, so a corrupt value must not get that far."""
    layers = {int(m.group(1)) for n in ckpt.entries if (m := _LAYER.match(n))}
    have = max(layers) + 1 if layers else 0
    if not have:
        raise ConvertError(f"{hf_dir}: the checkpoint has no {_LAYER_PREFIX}N tensors (no layers)")
    if cfg.n_layer > have:
        raise ConvertError(f"{os.path.join(hf_dir, 'config.json')}: num_hidden_layers = {cfg.n_layer}, but the "
                           f"checkpoint has tensors for {have} layers ({_LAYER_PREFIX}0 to {have - 1})")
    src = "model.embed_tokens.weight"
    e = ckpt.entries.get(src)
    if e is None:
        raise ConvertError(f"{hf_dir}: tensor {src} is missing from the checkpoint")
    if tuple(e.shape) != (cfg.n_vocab, cfg.n_embd):
        raise ConvertError(f"{e.file.path}: tensor {src} has shape {list(e.shape)}, config.json implies "
                           f"{[cfg.n_vocab, cfg.n_embd]}")


def _model_name(hf_dir: str) -> str:
    """general.name when none is given: the folder's name, or for a Hugging Face cache's snapshot
    (models--Org--Name/snapshots/<commit>) the repository's, Name (llama.cpp's converter finds it in
    config.json's _name_or_path or the model card): the commit's hash names no model."""
    path = os.path.abspath(hf_dir)
    parent, leaf = os.path.split(path)
    cache_entry, snapshots = os.path.split(parent)
    repo = os.path.basename(cache_entry)
    # (the cache writes "models--" + the repo id with "/" as "--"; the Hub allows no "--" in an id)
    if snapshots == "snapshots" and repo.startswith("models--") and len(repo) > len("models--"):
        return repo.split("--")[-1]
    return leaf


def convert(hf_dir, out, type: str = "f16", progress: bool = False, name: str | None = None) -> str:
    """Converts the Hugging Face model folder `hf_dir` to the GGUF file `out` of output type `type`
    (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_m, q5_k_m, q6_k, iq4_nl, iq4_xs, mxfp4_moe). Streams
    tensor by tensor; `out` appears only when complete. `name` is general.name (by default the folder's name, or
    for a Hugging Face cache's snapshot its repository's). Raises ConvertError for input it cannot convert
    or an output it cannot write. Returns `out`."""
    hf_dir, out = os.fspath(hf_dir), os.fspath(out)
    ot = quant_mix.out_type(type)
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"{hf_dir}: not a folder (a Hugging Face model folder is expected)")
    check_output_path(out)  # (a folder, or a missing one: said now, not after the conversion)
    _check_not_an_input(hf_dir, out)
    cfg = _checked(os.path.join(hf_dir, "config.json"), lambda: hf_config.load_config(hf_dir))

    with Checkpoint(hf_dir) as ckpt:
        _check_sizes(hf_dir, cfg, ckpt)  # (before the tokenizer and the plan, whose cost grows with them)
        vocab = _checked(f"{hf_dir}: the tokenizer files", lambda: tokenizer.load_vocab(
            hf_dir, cfg.n_vocab, prefer_bpe=cfg.arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss")))
        _special_ids_from_config(vocab, cfg)
        if cfg.arch in ("gemma2", "gemma3"):  # as llama.cpp's Gemma converters: BOS added, no space prefix
            vocab.setdefault("add_bos", True)
            if vocab["model"] == "llama":
                vocab["add_space_prefix"] = False
        if cfg.activation == "relu" and cfg.arch == "llama":
            warnings.warn(f"{hf_dir}: hidden_act relu is written as optiml.ffn.activation, which llama.cpp does "
                          "not read: llama.cpp runs this file with SiLU, a different model; OptiML runs it as "
                          "trained", stacklevel=2)

        plan = hf_config.tensor_plan(cfg, set(ckpt.entries))
        used = {src for p in plan for src, _ in p.expected}
        unused = sorted(n for n in ckpt.entries if n not in used and not n.endswith("rotary_emb.inv_freq")
                        and not (cfg.tie_embeddings and n == "lm_head.weight"))
        if unused:
            warnings.warn(f"{hf_dir}: {len(unused)} tensors of the checkpoint are not in config.json's model and "
                          f"are left out: {', '.join(unused[:6])}{', ...' if len(unused) > 6 else ''}", stacklevel=2)
        for p in plan:  # everything is checked before the output is created
            for src, shape in p.expected:
                e = ckpt.entries.get(src)
                if e is None:
                    raise ConvertError(f"{hf_dir}: tensor {src} is missing from the checkpoint")
                if tuple(e.shape) != tuple(shape):
                    raise ConvertError(f"{e.file.path}: tensor {src} has shape {list(e.shape)}, config.json "
                                       f"implies {list(shape)}")
                if (e.dtype == "U8") != (p.raw is not None):
                    raise ConvertError(f"{e.file.path}: tensor {src} is {e.dtype}, "
                                       f"{'bytes (U8)' if p.raw is not None else 'a float type'} expected")
        has_output = any(p.name == "output.weight" for p in plan)

        def compute(p):
            def run():
                if p.parts:  # a layer's experts, stacked into one [n_expert, rows, cols] tensor
                    x = np.empty(p.gguf_shape, np.float32)
                    for i, src in enumerate(p.parts):
                        x[i] = ckpt.entries[src].load()
                    return x
                if p.build:
                    return p.build([ckpt.entries[src].load() for src in p.sources])
                e = ckpt.entries[p.source]
                x = e.load()
                if p.add_one:
                    x = hf_config.add_one(x, e.dtype)
                x = hf_config.permute_qk(x, p.permute_heads) if p.permute_heads else x
                return x.reshape(p.gguf_shape)
            return run

        tensors = [(p.name, p.gguf_shape, gguf.GGMLQuantizationType(p.raw) if p.raw is not None else
                    quant_mix.tensor_type(p.name, p.gguf_shape, ot, cfg.n_layer, has_output, cfg.n_expert,
                                          cfg.n_gqa), compute(p))
                   for p in plan]
        if cfg.rope_scaling["rope_type"] == "llama3":
            factors = hf_config.llama3_rope_factors(cfg)
            tensors.insert(0, ("rope_freqs.weight", factors.shape, gguf.GGMLQuantizationType.F32, lambda: factors))
        tensors[:0] = [(n, x.shape, gguf.GGMLQuantizationType.F32, lambda x=x: x) for n, x in phi3.extra_tensors(cfg)]

        label = name or _model_name(hf_dir)
        writer.write_gguf(out, cfg.arch, lambda w: _add_metadata(w, cfg, ot, vocab, label), tensors, progress)
    return out
