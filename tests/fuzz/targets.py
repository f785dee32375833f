"""Python fuzz targets: each is a function of one input (bytes) that must either succeed or raise one of
the exceptions listed for it (OptimlError and its subclasses; for templates, ChatTemplateError).
Anything else -- another exception, a crash, a hang, memory without bound -- is a bug. tools/checks/fuzz.py
runs them under atheris (coverage-guided); tests/test_fuzz.py replays the seeds and a fixed number of
inputs on every CI run.

    template   a chat template (the input, as UTF-8) rendered with a conversation
    convert    a Hugging Face folder, one of its files replaced by the input (first byte: which one),
               converted to GGUF: config.json, tokenizer.json, tokenizer_config.json, model.safetensors
    gguf       a GGUF file through the Python layer: optiml.gguf, placement and sparsity readers,
               tokenizer, chat template, optiml.Model with one token generated
    tokenizer  arbitrary bytes encoded and decoded by a real vocabulary (first byte: which one)
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SCRATCH = tempfile.mkdtemp(prefix="optiml-fuzz-")  # inputs written as files; removed at exit
atexit.register(shutil.rmtree, SCRATCH, True)


def _optiml_errors():
    import optiml

    return (optiml.OptimlError,)


# ---- template --------------------------------------------------------------------------------------
HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{{ 10 ** 100000000 }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ '%1000000000s' % 'x' }}",
    "{{ '{:>1000000000}'.format('x') }}",
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}{{ messages|length }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception('refused') }}",
]


def template_seeds() -> list[bytes]:
    from optiml.engine.chat_template import CHATML_TEMPLATE, PLAIN_TEMPLATE

    seeds = [CHATML_TEMPLATE, PLAIN_TEMPLATE] + HOSTILE_TEMPLATES
    for path in _reference_models():
        from optiml.engine.chat_template import read_template

        t = read_template(path)
        if t:
            seeds.append(t)
    return [s.encode() for s in seeds]


def _template_errors():
    # Every failure of a template (syntax, the sandbox, its own raise_exception, errors while rendering,
    # the limits) is a ChatTemplateError, an OptimlError naming the template (issue #47): a raw jinja2 or
    # Python exception escaping ChatTemplate is a bug. MemoryError is not allowed either.
    from optiml import ChatTemplateError

    return (ChatTemplateError,)


def template(data: bytes) -> None:
    from optiml.engine.chat_template import ChatTemplate

    source = data.decode("utf-8", "replace")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "{{ 7 * 7 }}"}]
    try:
        tpl = ChatTemplate(source, "<s>", "</s>")
        # A fuzz hang is 1 s: the limits must stop a hostile template well before that, also under
        # atheris' instrumentation (tests/test_hardening.py checks the default limits).
        tpl.max_render_seconds = 0.25
        tpl.max_output_chars = 1 << 16
        text = tpl.render(messages, add_generation_prompt=True)
        assert isinstance(text, str)
    except _template_errors():
        pass


# ---- convert ---------------------------------------------------------------------------------------
CONVERT_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def convert_folder_files() -> dict[str, bytes]:
    """A tiny valid Llama checkpoint: 40-token byte-level BPE vocabulary, 1 layer of width 32."""
    n_vocab, n_embd, n_ff, n_head, n_kv = 40, 32, 64, 4, 2
    hd = n_embd // n_head
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": n_vocab,
           "hidden_size": n_embd, "intermediate_size": n_ff, "num_hidden_layers": 1,
           "num_attention_heads": n_head, "num_key_value_heads": n_kv, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": True,
           "bos_token_id": 37, "eos_token_id": 38, "hidden_act": "silu"}
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ċ", "ab", "Ġa", "th", "Ġth", "he", "in",
                                                                  "er", "an", "on"]
    vocab = {t: i for i, t in enumerate(letters)}
    merges = ["a b", "Ġ a", "t h", "Ġ th", "h e", "i n", "e r", "a n", "o n"]
    vocab = dict(list(vocab.items())[:37])
    tj = {"version": "1.0", "added_tokens": [
            {"id": 37, "content": "<|im_start|>", "special": True, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False},
            {"id": 38, "content": "<|im_end|>", "special": True, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False},
            {"id": 39, "content": "<|endoftext|>", "special": True, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False}],
          "normalizer": None,
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                            "use_regex": True},
          "post_processor": None, "decoder": {"type": "ByteLevel"},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False,
                    "vocab": vocab, "merges": merges}}
    tc = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
          "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}"}
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.normal(0, 0.05, shape).astype(np.float32)  # noqa: E731
    p = "model.layers.0."
    tensors = {"model.embed_tokens.weight": w(n_vocab, n_embd), "model.norm.weight": np.ones(n_embd, np.float32),
               p + "self_attn.q_proj.weight": w(n_head * hd, n_embd), p + "self_attn.k_proj.weight": w(n_kv * hd, n_embd),
               p + "self_attn.v_proj.weight": w(n_kv * hd, n_embd), p + "self_attn.o_proj.weight": w(n_embd, n_embd),
               p + "mlp.gate_proj.weight": w(n_ff, n_embd), p + "mlp.up_proj.weight": w(n_ff, n_embd),
               p + "mlp.down_proj.weight": w(n_embd, n_ff), p + "input_layernorm.weight": np.ones(n_embd, np.float32),
               p + "post_attention_layernorm.weight": np.ones(n_embd, np.float32)}
    return {"config.json": json.dumps(cfg).encode(), "tokenizer.json": json.dumps(tj).encode(),
            "tokenizer_config.json": json.dumps(tc).encode(), "model.safetensors": _safetensors(tensors)}


_CONVERT_BASE: dict[str, bytes] | None = None


def convert_seeds() -> list[bytes]:
    files = convert_folder_files()
    return [bytes([i]) + files[name] for i, name in enumerate(CONVERT_FILES)]


def convert(data: bytes) -> None:
    global _CONVERT_BASE
    from optiml.convert import convert as run_convert

    if _CONVERT_BASE is None:
        _CONVERT_BASE = convert_folder_files()
    if not data:
        return
    folder = os.path.join(SCRATCH, "hf")
    os.makedirs(folder, exist_ok=True)
    files = dict(_CONVERT_BASE)
    files[CONVERT_FILES[data[0] % len(CONVERT_FILES)]] = data[1:]
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)
    out = os.path.join(SCRATCH, "out.gguf")
    try:
        run_convert(folder, out, type="f32" if data[0] & 0x80 else "q8_0")
    except _optiml_errors():
        return
    # What the converter wrote must load (or be refused with a clear error).
    _load_gguf(out)


# ---- gguf (Python layer) -------------------------------------------------------------------------------
def gguf_seeds() -> list[bytes]:
    sys.path.insert(0, HERE)
    import seeds as seed_module

    out_dir = os.path.join(SCRATCH, "gguf-seeds")
    return [open(p, "rb").read() for p in seed_module.write_gguf_seeds(out_dir)]


def _load_gguf(path: str) -> None:
    import optiml
    from optiml import gguf as og
    from optiml import tokenizer
    from optiml.formats import placement
    from optiml.engine.chat_template import ChatTemplate, read_template

    errors = _optiml_errors()
    try:
        with og.open(path) as f:
            for t in f.tensors[:8]:
                f.tensor_data(t.name)
        placement.read_placement(path)
    except errors:
        return
    try:
        tok = tokenizer.Tokenizer.from_file(path)
        ids = tok.encode("Hi <|im_start|> the\xff", parse_special=True)
        tok.decode(ids)
        tpl = ChatTemplate.for_tokenizer(read_template(path), tok)
        tpl.max_render_seconds = 0.25
        tpl.max_output_chars = 1 << 16
        tpl.render([{"role": "user", "content": "Hi"}])
    except errors + _template_errors():
        pass
    try:
        m = optiml.Model(path, n_ctx=16)
        if m.n_vocab <= 4096:
            m.generate("Hi", max_tokens=1)
    except errors:
        pass


def gguf(data: bytes) -> None:
    path = os.path.join(SCRATCH, "in.gguf")
    with open(path, "wb") as f:
        f.write(data)
    _load_gguf(path)


# ---- tokenizer ---------------------------------------------------------------------------------------
_TOKENIZERS: list | None = None


def _reference_models() -> list[str]:
    from optiml.hub.registry import cache_dir

    cache = str(cache_dir())
    names = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m-Q4_K_M.gguf"]
    return [os.path.join(cache, n) for n in names if os.path.isfile(os.path.join(cache, n))]


def tokenizer_seeds() -> list[bytes]:
    texts = ["Hello world!", "  leading spaces\n\ttabs 1234567 <|im_start|>user\n", "héllo wörld 日本語 🙂",
             "\xff\xfe invalid", "<start_of_turn>model\n<end_of_turn>", "a" * 300]
    return [bytes([k]) + t.encode("utf-8", "surrogateescape") for k in range(2) for t in texts]


def tokenizer(data: bytes) -> None:
    global _TOKENIZERS
    from optiml.tokenizer import Tokenizer

    if _TOKENIZERS is None:
        _TOKENIZERS = [Tokenizer.from_file(p) for p in _reference_models()] or [
            Tokenizer.from_file(os.path.join(SCRATCH, "gguf-seeds", "llama-bpe-f32.gguf"))]
    if not data:
        return
    tok = _TOKENIZERS[data[0] % len(_TOKENIZERS)]
    text = data[1:]
    for special in (False, True):
        ids = tok.encode(text, add_special=special, parse_special=special)
        assert all(0 <= i < tok.n_vocab for i in ids)
        back = tok.decode(ids)
        assert isinstance(back, str)
    s = text.decode("utf-8", "replace")
    tok.encode(s)


TARGETS = {
    "template": (template, template_seeds),
    "convert": (convert, convert_seeds),
    "gguf": (gguf, gguf_seeds),
    "tokenizer": (tokenizer, tokenizer_seeds),
}
