"""Native tokenizer (optiml.tokenizer) against independent oracles.

- SmolLM2 (byte-level BPE, pre-tokenizer "smollm"): transformers' AutoTokenizer(gguf_file=...),
  which converts the GGUF's tokenizer itself. Its conversion drops the digit-splitting step of the
  original SmolLM2 tokenizer (llama.cpp keeps it: "smollm" = \\p{N} then the GPT-2 regex), so the
  full corpus is also compared with that converted tokenizer given SmolLM2's real pre-tokenizer
  (Digits(individual_digits) + ByteLevel), which is what the model was trained with.
- SentencePiece ("llama"): a small BPE model trained here with the sentencepiece package, written to
  a GGUF with gguf-py; compared with sentencepiece's own encoder (and transformers' conversion).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import optiml
from optiml import tokenizer as T

from conftest import llama_cpp_module
from conftest import shared_eval_text as scandal_text


CORPUS = [
    "The capital of France is",
    "Hello, world! How are you doing today?",
    "I'm sure they'll say it's fine; we've done what we'd planned. DON'T SHOUT, it'S ok",
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "a",
    # unicode: accents, CJK, emoji (incl. ZWJ sequences and flags), combining marks, RTL, odd spaces
    "Café naïve résumé Ångström façade coöperate",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🙂😀🎉 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 combining",
    "مرحبا بالعالم שלום עולם",
    "Ελληνικά, русский язык, ไทย, हिन्दी",
    "non\u00a0breaking\u2003em\u3000ideographic\u200bzero-width",
    "\u2028line\u2029para\u0085nel",
    # whitespace runs
    "a  b   c    d",
    "trailing spaces   ",
    "   leading spaces",
    "tabs\t\tand\t \tmixed \t\n\n\r\n  runs",
    "\n\n\nnewlines\n\n",
    "line one\r\nline two\r\n\r\n",
    "x  1 y   22 z\t3\n4",
    # digits
    "1234567890 12 345 6789 3.14159 -42 +7 1e10 0x1F 1,000,000",
    "Call 555-1234 or +1 (800) 555-0000 before 2024-12-31T23:59:59Z",
    "Ⅻ ½ ² ٣ ۴ ௫",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "x = {'a': [1, 2, 3], \"b\": None}  # comment\n\n\nclass A(B):\n    pass",
    "<div class=\"x\">&nbsp;</div> a->b && c || !d; i++; j--; k <<= 2;",
    "''' \"\"\" `` ~~ ^^ $$ @@ ## %% && ** (( )) [[ ]] {{ }} ||",
    # special tokens spelled in text
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|>text<|endoftext|>",
    "<|im_start|><|im_end|><|im_start|>",
    "almost <|im_start| special <im_end|> tokens <|im_end",
    "<repo_name>optiml<file_sep>a.py<filename>b<gh_stars>10",
]


# ---------------------------------------------------------------------------------------------
# SmolLM2 (gpt2 BPE, pre-tokenizer "smollm")


@pytest.fixture(scope="module")
def smol(smollm2_path) -> T.Tokenizer:
    return T.load(smollm2_path)


@pytest.fixture(scope="module")
def hf_smol(smollm2_path):
    """transformers' conversion of the GGUF tokenizer (independent of our reader)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def hf_smol_digits(hf_smol):
    """The converted tokenizer with SmolLM2's real pre-tokenizer: digits alone, then ByteLevel."""
    from tokenizers import pre_tokenizers

    backend = hf_smol.backend_tokenizer
    import copy

    t = copy.deepcopy(backend)
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    return t


def test_smollm2_metadata(smol):
    assert smol.model_name == "gpt2"
    assert smol.pre_name == "smollm"
    assert smol.n_vocab == 49152 == len(smol)
    assert (smol.bos_id, smol.eos_id) == (1, 2)
    assert smol.add_bos is False and smol.add_eos is False
    # <|endoftext|>, <|im_end|> and (as llama.cpp's FIM repo token) <reponame> end generation.
    assert smol.eog_ids == [0, 2, 4]
    assert smol.is_eog(2) and smol.is_eog(0) and not smol.is_eog(1) and not smol.is_eog(504)
    assert smol.is_eog(-1) is False and smol.is_eog(10**6) is False
    assert smol.is_control(1) and not smol.is_control(504)
    assert smol.token_text(504) == b"The"
    assert smol.token_text(3575) == "Ġcapital".encode()
    assert smol.token_id("<|im_start|>") == 1 and smol.token_id("no such token") == -1
    assert smol.token_type(1) == 3 and smol.token_type(504) == 1
    assert repr(smol) == "<optiml.tokenizer.Tokenizer gpt2/smollm, 49152 tokens>"


def test_smollm2_known_ids(smol):
    assert smol.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert smol.encode("The capital of France is", add_special=False) == [504, 3575, 282, 4649, 314]
    assert smol.encode("") == []


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_matches_transformers(smol, hf_smol, hf_smol_digits, text):
    ours = smol.encode(text, add_special=False, parse_special=True)
    assert ours == hf_smol_digits.encode(text, add_special_tokens=False).ids
    if ours != hf_smol.encode(text, add_special_tokens=False):
        # Only whitespace before a digit may differ: transformers' GGUF conversion has no Digits
        # step, so " " + "1" can pre-tokenize together there.
        assert any(c.isspace() and n.isdigit() for c, n in zip(text, text[1:])), text


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_parse_special_false(smol, hf_smol, text):
    ours = smol.encode(text, add_special=False, parse_special=False)
    theirs = hf_smol.encode(text, add_special_tokens=False, split_special_tokens=True)
    if not any(c.isspace() and n.isdigit() for c, n in zip(text, text[1:])):
        assert ours == theirs
    assert all(not smol.is_control(i) for i in ours)


def test_smollm2_digits_split_alone(smol, hf_smol):
    # smollm: \p{N} first, so each digit is its own piece and a space before a digit stands alone.
    ids = smol.encode("x  1 2024", add_special=False)
    assert [smol.token_to_piece(i) for i in ids] == [b"x", b"  ", b"1", b" ", b"2", b"0", b"2", b"4"]
    # transformers' conversion keeps " 1" together, which llama.cpp and SmolLM2's own tokenizer don't.
    hf = hf_smol.encode("x  1 2024", add_special_tokens=False)
    assert [hf_smol.convert_ids_to_tokens(i) for i in hf][:3] == ["x", "Ġ", "Ġ"]


def test_smollm2_special_tokens(smol):
    chat = "<|im_start|>user\nhi<|im_end|>\n"
    assert smol.encode(chat, parse_special=True) == [1, 4093, 198, 6004, 2, 198]
    plain = smol.encode(chat, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(plain) == chat
    assert smol.decode(smol.encode(chat, parse_special=True)) == "user\nhi\n"
    assert smol.decode(smol.encode(chat, parse_special=True), render_special=True) == chat
    assert smol.token_to_piece(2) == b"<|im_end|>"
    assert smol.token_to_piece(2, render_special=False) == b""


def test_smollm2_whole_story(smol, hf_smol):
    text = scandal_text()
    ours = smol.encode(text)
    assert ours == hf_smol.encode(text, add_special_tokens=False)
    assert smol.decode(ours) == text


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_round_trip(smol, text):
    assert smol.decode(smol.encode(text, parse_special=True), render_special=True) == text
    assert smol.decode(smol.encode(text, parse_special=False)) == text


def test_smollm2_decode_matches_transformers(smol, hf_smol):
    text = "Emoji 🙂 and café\n\tcode()"
    ids = smol.encode(text)
    assert smol.decode(ids) == hf_smol.decode(ids) == text


def test_token_to_piece_bytes(smol):
    ids = smol.encode("🙂")
    pieces = [smol.token_to_piece(i) for i in ids]
    assert b"".join(pieces) == "🙂".encode()
    assert len(ids) > 1  # an emoji spread over byte-level tokens: pieces are partial UTF-8


def test_streaming_detokenizer(smol):
    text = "Emoji: 🙂😀🎉 👩‍👩‍👧‍👦 🇫🇷 — 東京 café\n" + "".join(CORPUS[9:16])
    ids = smol.encode(text)
    d = smol.detokenizer()
    out = []
    for i in ids:
        s = d.push(i)
        s.encode("utf-8")  # always valid UTF-8 (a str from the binding)
        assert "\ufffd" not in s
        out.append(s)
    out.append(d.flush())
    assert "".join(out) == text
    # Some piece ended inside a character and was held back.
    assert any(not smol.token_to_piece(i).decode("utf-8", "ignore") for i in ids)


def test_streaming_holds_partial_and_flushes(smol):
    ids = smol.encode("🙂")
    d = smol.detokenizer()
    assert d.push(ids[0]) == ""
    assert d.pending_bytes > 0
    assert d.flush() == "\ufffd"  # a cut-off character
    assert d.pending_bytes == 0
    assert "".join(d.push(i) for i in ids) == "🙂"


def test_streaming_special_tokens(smol):
    ids = smol.encode("<|im_start|>hi<|im_end|>", parse_special=True)
    assert "".join(smol.detokenizer().push(i) for i in ids) == "hi"
    assert "".join(smol.detokenizer(render_special=True).push(i) for i in ids) == "<|im_start|>hi<|im_end|>"


def test_invalid_utf8_bytes(smol):
    """Bytes that are not UTF-8 are read as llama.cpp reads them before a byte-level BPE vocabulary: each
    byte that starts no complete sequence is U+FFFD (one token for SmolLM2), nothing is dropped."""
    fffd = smol.encode("\ufffd", add_special=False)
    assert len(fffd) == 1
    assert smol.encode(b"\xff", add_special=False) == fffd  # (SmolLM2 has no token for the byte 0xFF)
    assert smol.encode(b"a\xffb", add_special=False) == smol.encode("a\ufffdb", add_special=False)
    raw = b"ok \x80\xe2 \xe2\x82 end \xf0\x9f"
    ids = smol.encode(raw)
    assert smol.decode(ids) == "ok \ufffd\ufffd \ufffd\ufffd end \ufffd\ufffd"  # (one per byte; Python's
    # "replace" gives one for a truncated sequence)
    d = smol.detokenizer()
    assert "".join(d.push(i) for i in ids) + d.flush() == smol.decode(ids)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_invalid_utf8_bytes_match_llama_cpp(request, name):
    """The same bytes, fixed and random, tokenized by llama-cpp-python: the same ids, for byte-level BPE
    (SmolLM2) and SentencePiece with byte fallback (Gemma 3: a lead byte takes the bytes after it into its
    symbol, as in llama.cpp). (Not 0xF4-0xF7 leads: llama.cpp aborts the process on a sequence past U+10FFFF.)"""
    import random

    path = request.getfixturevalue(f"{name}_path")
    with optiml.gguf.open(path) as f:
        smol = T.Tokenizer.from_gguf(f)
    llama_cpp = llama_cpp_module()
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    rng = random.Random(7)
    pool = [b for b in range(256) if not 0xF4 <= b <= 0xF7]
    texts = [b"a\xff\xfe b", b"caf\xe9 x", b"caf\xe9 na\xef", b"\xc3", b"x\xc3\xa9\xed\xa0\x80y", b"\xc0\x80z",
             b"<|im_start|>\xff", b"\xe2\x96 \xf0 "]
    texts += [bytes(rng.choice(b" ab\xc3\xa9\xe2\x82\xac\xf0\x9f\x99\x82'0") if rng.random() < 0.6 else rng.choice(pool)
                    for _ in range(rng.randrange(14))) for _ in range(400)]
    for raw in texts:
        for special in (False, True):
            want = ref.tokenize(raw, add_bos=False, special=special)
            assert smol.encode(raw, add_special=False, parse_special=special) == want, (raw, special)


def test_bad_ids(smol):
    with pytest.raises(optiml.ArgumentError, match="outside the vocabulary"):
        smol.decode([1, 49152])
    with pytest.raises(ValueError):
        smol.decode([-1])
    with pytest.raises(optiml.ArgumentError):
        smol.decode([2**40])
    with pytest.raises(optiml.ArgumentError):
        smol.token_to_piece(49152)
    with pytest.raises(optiml.ArgumentError):
        smol.detokenizer().push(-5)


def test_from_open_gguf(smollm2_path):
    with optiml.gguf.open(smollm2_path) as f:
        tok = T.Tokenizer.from_gguf(f)
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_encode_threads_release_gil(smol):
    from concurrent.futures import ThreadPoolExecutor

    text = scandal_text()
    want = smol.encode(text)
    with ThreadPoolExecutor(4) as ex:
        assert all(r == want for r in ex.map(lambda _: smol.encode(text), range(8)))


# ---------------------------------------------------------------------------------------------
# Crafted GGUF files: pre-tokenizers we cannot verify on a real model, and bad metadata.


def _write_gguf(path: Path, kv: dict) -> Path:
    import gguf

    from hf_gguf import write_and_close

    w = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in kv.items():
        getattr(w, f"add_{kind}")(key, value)
    write_and_close(w)
    return path


def _bpe_kv(pre="gpt2", tokens=None, merges=None, types=None, **extra):
    tokens = tokens or ["a", "b", "ab", "Ġ", "Ġab", "<|end|>"]
    kv = {
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.tokens": ("array", tokens),
        "tokenizer.ggml.token_type": ("array", types or [1] * (len(tokens) - 1) + [3]),
        "tokenizer.ggml.merges": ("array", merges or ["a b", "Ġ ab"]),
    }
    if pre is not None:
        kv["tokenizer.ggml.pre"] = ("string", pre)
    kv.update(extra)
    return kv


HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def test_harmony_markers_render_and_end_generation(tmp_path):
    """gpt-oss's vocabulary (harmony): <|return|> and <|call|> end generation, <|end|> only a message, and the
    markers framing a message render as text in generated output (as llama.cpp renders them) so that the
    reasoning and the answer can be told apart; a vocabulary without <|return|>/<|call|> is unchanged."""
    tokens = ["a", "b", "ab", "Ġ", "Ġab", "<|endoftext|>", *HARMONY]
    kv = _bpe_kv(tokens=tokens, types=[1] * 5 + [3] * 8, **{"tokenizer.ggml.eos_token_id": ("uint32", 10)})
    tok = T.load(_write_gguf(tmp_path / "h.gguf", kv))
    ids = {t: tokens.index(t) for t in HARMONY}
    assert tok.is_eog(ids["<|return|>"]) and tok.is_eog(ids["<|call|>"]) and not tok.is_eog(ids["<|end|>"])
    text = [ids["<|channel|>"], 2, ids["<|message|>"], 4, ids["<|end|>"], ids["<|start|>"], 0, ids["<|return|>"]]
    assert tok.decode(text) == "<|channel|>ab<|message|> ab<|end|><|start|>a"
    d = tok.detokenizer()  # what generation streams (Generator and the server's output stage use it)
    assert [d.push(i) for i in text] + [d.flush()] == ["<|channel|>", "ab", "<|message|>", " ab", "<|end|>",
                                                       "<|start|>", "a", "", ""]
    assert not tok.is_control(ids["<|channel|>"]) and tok.is_control(ids["<|return|>"])
    assert tok.decode([5, 2]) == "ab"  # other control tokens stay hidden
    plain = T.load(_write_gguf(tmp_path / "p.gguf", _bpe_kv(tokens=tokens[:6] + HARMONY[:4],
                                                              types=[1] * 5 + [3] * 5)))
    assert plain.decode([6, 2, 7]) == "ab" and plain.is_eog(9)


def test_crafted_bpe(tmp_path):
    tok = T.load(_write_gguf(tmp_path / "t.gguf", _bpe_kv()))
    assert tok.encode("ab ab") == [2, 4]
    assert tok.encode("ab<|end|>", parse_special=True) == [2, 5]
    assert tok.is_eog(5)  # recognised by its text
    assert tok.decode([2, 4]) == "ab ab"


def test_unsupported_pre_tokenizer(tmp_path):
    path = _write_gguf(tmp_path / "t.gguf", _bpe_kv(pre="no-such-pre"))
    with pytest.raises(optiml.UnsupportedModelError, match="no-such-pre.*supported:.*smollm.*llama3.*qwen2"):
        T.load(path)


def test_unsupported_model(tmp_path):
    kv = _bpe_kv()
    kv["tokenizer.ggml.model"] = ("string", "bert")
    with pytest.raises(optiml.UnsupportedModelError, match="'bert'.*gpt2.*llama"):
        T.load(_write_gguf(tmp_path / "t.gguf", kv))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.token_type": ("array", [1, 1])}, "token_type has 2 entries for 6 tokens"),
        ({"tokenizer.ggml.scores": ("array", [0.0] * 3)}, "scores has 3 entries"),
        ({"tokenizer.ggml.eos_token_id": ("uint32", 6)}, "eos_token_id = 6 is outside the vocabulary"),
        ({"tokenizer.ggml.merges": ("array", ["nospace"])}, "merges\\[0\\]"),
        ({"tokenizer.ggml.tokens": ("array", ["a", "a", "b", "c", "d", "e"])}, "duplicate token"),
        ({"tokenizer.ggml.token_type": ("array", [1, 1, 1, 1, 1, 9])}, "token_type\\[5\\] = 9"),
        ({"tokenizer.ggml.add_bos_token": ("bool", True)}, "add_bos_token is true but there is no BOS"),
        ({"tokenizer.ggml.tokens": ("array", [1, 2, 3])}, "tokens is missing or not an array of strings"),
    ],
)
def test_bad_metadata(tmp_path, change, match):
    kv = _bpe_kv()
    kv.update(change)
    with pytest.raises(optiml.GGUFError, match=match):
        T.load(_write_gguf(tmp_path / "t.gguf", kv))


def test_no_tokenizer(tmp_path):
    with pytest.raises(optiml.GGUFError, match="no tokenizer.ggml.model"):
        T.load(_write_gguf(tmp_path / "t.gguf", {"general.name": ("string", "x")}))


# Pre-tokenizers on crafted vocabularies: our pieces against HF tokenizers' own regex splitting.
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss), as its tokenizer.json and llama.cpp's comment spell it.
_O200K_WORD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _O200K_WORD +
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _O200K_WORD +
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp runs one after the other (llm_tokenizer_bpe), each
# splitting the pieces of the one before into matches and the text between them.
PRE_CASES = {
    "gpt2": [GPT2_RE],
    "smollm": [r"\p{N}", GPT2_RE],
    "starcoder": [r"\p{N}", GPT2_RE],
    "llama-bpe": [LLAMA3_RE],
    "qwen2": [LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE, r"\p{N}+", "[0-9][0-9][0-9]"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, "[0-9][0-9][0-9]"],
    "gpt-4o": [GPT4O_RE],
}


def _hf_split(patterns: list[str], text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    return [p for p, _ in pre_tokenizers.Sequence(steps).pre_tokenize_str(text)]


def _pre_tokenizer(tmp_path, pre: str) -> T.Tokenizer:
    kv = _bpe_kv(pre=pre)
    kv["tokenizer.ggml.add_bos_token"] = ("bool", False)  # llama3 names default to adding a BOS
    return T.load(_write_gguf(tmp_path / f"{pre}.gguf", kv))


@pytest.mark.parametrize("pre", sorted(PRE_CASES))
def test_pre_tokenizer_splits_match_hf(tmp_path, pre):
    tok = _pre_tokenizer(tmp_path, pre)
    texts = [t for t in CORPUS if t] + [scandal_text()]
    texts += ["I'M HE'LL 'S 'Re 'vE x'ΣS", "a\r\n\r\n  b  \n  c \t\n", "((( abc ))) ...\n\n x", "12345678 1234"]
    for text in texts:
        want = [p.encode() for p in _hf_split(PRE_CASES[pre], text)]
        assert tok.pre_tokenize(text) == want, text


# gpt-4o: two case-aware word alternatives over letter classes that overlap (Lm, Lo and marks are
# in both), a case-insensitive contraction ending a word, digits in threes, "/" after line breaks.
GPT4O_TEXTS = [
    "HELLOworld HelloWorld camelCaseWord XMLHttpRequest ABCd aBC A a I'M WE'LL don't They'RE it'S x'ſ",
    "'s 'T 're 'Ve 'm 'LL 'd '' 'x 'ſt HELLO'S hello'sworld",
    "1234567 12 3.14159 -42 ٣٤٥٦ ²³ Ⅻ 1a2b3",
    "!!!\n//x ((( abc ))) ...\n\n x a/b\n/c ?\r\n/ end;\n\n// comment\n",
    "trailing   \n  \n\t x  y   \t\n\n z  ",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "مرحبا بالعالم שלום עולם",
    "ΓειαΣου ДокументПродажиТоваров ÉCOLE École ǅungla ǅA Ǆ ǆ",  # Lt: U+01C5
    "e\u0301te\u0301 \u0301A x\u0301\u0301Y a\u0308 n\u0303 \u0915\u094d\u0937 नमस्ते दुनिया",  # M
    "aʰB ʰA ˆx ªº ー々 xー",  # Lm: U+02B0, U+02C6
    "Emoji: 🙂😀🎉 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "non\u00a0breaking\u2003em\u3000ideographic\u200bzero-width \u2028line\u2029para\u0085nel",
]
# Characters of every class the alternatives tell apart, for random strings.
GPT4O_ALPHABET = list("aZ'sStTrReEvVmMlLdD /!.19-_$\n\r\t") + [
    "\u0301", "\u0903", "\u20dd", "\u01c5", "\u01c4", "\u01c6", "\u02b0", "東", "ا", "\u0915", "\u094d", "Σ", "σ",
    "Д", "д", "ſ", "İ", "ı", "\u00a0", "\u3000", "\u0085", "🙂", "\u200d", "\u00ad", "²", "٣", "ª"]


def test_gpt4o_splits_match_regex(tmp_path):
    # Both HF tokenizers (Oniguruma) and Python's regex module run the regex itself.
    regex = pytest.importorskip("regex")
    import random

    tok = _pre_tokenizer(tmp_path, "gpt-4o")
    rng = random.Random(4)
    texts = GPT4O_TEXTS + ["".join(rng.choice(GPT4O_ALPHABET) for _ in range(rng.randrange(1, 24)))
                           for _ in range(3000)]
    for text in texts:
        want = [m.group().encode() for m in regex.finditer(GPT4O_RE, text)]
        assert [p.encode() for p in _hf_split([GPT4O_RE], text)] == want, text  # the oracles agree
        assert tok.pre_tokenize(text) == want, text


def _llama_cpp_splits_alike(text: str) -> bool:
    """llama.cpp runs gpt-4o's regex with "a letter but a-z" / "a letter but A-Z" for the two letter
    classes and without the marks (std::regex knows no \\p{Lu}): the same split unless the text has
    a mark or a cased letter outside ASCII."""
    import unicodedata

    cats = [unicodedata.category(c) for c in text]
    return not any(c[0] == "M" or (c in ("Lu", "Ll", "Lt") and ord(ch) > 127) for c, ch in zip(cats, text))


def test_gpt4o_gguf_matches_hf_and_llama_cpp(tmp_path):
    # A byte-level BPE trained here on unsplit text, so that its merges cross the pieces' boundaries
    # and any other split would change the tokens; HF then encodes with the gpt-4o split.
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    texts = [t for t in CORPUS if t] + GPT4O_TEXTS
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(texts * 2, trainer)
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GPT4O_RE), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    kv = _bpe_kv(pre="gpt-4o", tokens=tokens, merges=merges, types=[1] * len(tokens))
    path = _write_gguf(tmp_path / "o200k.gguf", kv)
    tok = T.load(path)
    assert tok.pre_name == "gpt-4o" and not tok.add_bos  # llama.cpp's defaults for gpt-4o: no BOS
    texts += [scandal_text()[:3000]]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text).ids, text
        assert tok.decode(ids) == text
    llama_cpp = llama_cpp_module()
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    alike = [t for t in texts if _llama_cpp_splits_alike(t)]
    assert len(alike) > len(texts) // 2
    for text in alike:
        assert tok.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=False), text
    # The other names llama.cpp gives the same split.
    for name in ("llama4", "kanana2", "talkie", "minimax-m2"):
        kv["tokenizer.ggml.pre"] = ("string", name)
        other = T.load(_write_gguf(tmp_path / f"{name}.gguf", kv))
        assert other.encode(GPT4O_TEXTS[0]) == tok.encode(GPT4O_TEXTS[0])


# ---------------------------------------------------------------------------------------------
# SentencePiece ("llama")


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    import gguf

    from hf_gguf import write_and_close

    d = tmp_path_factory.mktemp("spm")
    story = scandal_text()
    extra = "Café naïve résumé 東京 日本語 中文 Ελληνικά русский язык 1234567890 def f(x):\n    return x\n"
    lines = [ln for ln in (story + extra * 20).splitlines() if ln.strip()]
    (d / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=800, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=0.9995, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(d / "m.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 1)
    w = gguf.GGUFWriter(str(d / "m.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    write_and_close(w)
    return sp, d / "m.gguf"


@pytest.fixture(scope="module")
def spm_tok(spm_files):
    return T.load(spm_files[1])


def test_spm_metadata(spm_tok):
    assert spm_tok.model_name == "llama" and spm_tok.pre_name == ""
    assert (spm_tok.bos_id, spm_tok.eos_id, spm_tok.unk_id) == (1, 2, 0)
    assert spm_tok.add_bos and not spm_tok.add_eos
    assert spm_tok.is_eog(2)


@pytest.mark.parametrize("text", CORPUS)
def test_spm_matches_sentencepiece(spm_files, spm_tok, text):
    sp, _ = spm_files
    ids = spm_tok.encode(text, add_special=False, parse_special=False)
    assert ids == sp.encode(text)
    assert spm_tok.encode(text) == [1] + ids  # add_bos
    assert spm_tok.decode(ids) == sp.decode(ids)


def test_spm_whole_story(spm_files, spm_tok):
    sp, _ = spm_files
    text = scandal_text()
    ids = spm_tok.encode(text, add_special=False)
    assert ids == sp.encode(text)
    assert spm_tok.decode(ids) == text


def test_spm_byte_fallback(spm_tok):
    ids = spm_tok.encode("🙂", add_special=False)
    # "▁" then the four bytes of the emoji as <0xXX> tokens
    assert [spm_tok.token_type(i) for i in ids][-4:] == [6, 6, 6, 6]
    assert spm_tok.token_text(ids[-4]) == b"<0xF0>"
    assert spm_tok.decode(ids) == "🙂"
    d = spm_tok.detokenizer()
    parts = [d.push(i) for i in spm_tok.encode("a 🙂 b")]
    assert "".join(parts) == "a 🙂 b" and "" in parts


def test_spm_round_trip(spm_tok):
    for text in CORPUS + [" lead", "  two"]:
        assert spm_tok.decode(spm_tok.encode(text)) == text


def test_spm_matches_transformers(spm_files, spm_tok):
    transformers = pytest.importorskip("transformers")
    _, path = spm_files
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in CORPUS + [scandal_text()[:4000]]:
        if text.startswith(" "):
            continue  # HF's Metaspace(prepend_scheme="first") adds no "▁" before a leading space
        assert spm_tok.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False), text


def test_llama3_defaults_and_ignore_merges(tmp_path):
    # "abc" is a token that no merge builds: llama3 takes a whole-token piece as it is.
    tokens = ["a", "b", "c", "ab", "abc", "<|begin_of_text|>", "<|eot_id|>"]
    kv = _bpe_kv(pre="llama-bpe", tokens=tokens, merges=["a b"], types=[1, 1, 1, 1, 1, 3, 3])
    kv["tokenizer.ggml.bos_token_id"] = ("uint32", 5)
    tok = T.load(_write_gguf(tmp_path / "l3.gguf", kv))
    assert tok.add_bos  # llama.cpp's default for llama3 when the file does not say
    assert tok.encode("abc") == [5, 4]
    assert tok.encode("abcab", add_special=False) == [3, 2, 3]  # not a token: merged as usual
    assert tok.is_eog(6) and tok.eot_id == 6
    kv = _bpe_kv(pre="gpt2", tokens=tokens, merges=["a b"], types=[1, 1, 1, 1, 1, 3, 3])
    assert T.load(_write_gguf(tmp_path / "g.gguf", kv)).encode("abc") == [3, 2]


def test_spm_special_tokens(spm_tok):
    # Control tokens only with parse_special; SentencePiece text after a special token gets the
    # leading "▁" again (llama.cpp).
    ids = spm_tok.encode("</s>Hello", add_special=False, parse_special=True)
    assert ids[0] == 2 and ids[1:] == spm_tok.encode("Hello", add_special=False)
    plain = spm_tok.encode("</s>Hello", add_special=False, parse_special=False)
    assert 2 not in plain
    assert spm_tok.decode(plain) == "</s>Hello"
    assert spm_tok.decode([1] + spm_tok.encode("Hi there", add_special=False)) == "Hi there"
    assert spm_tok.decode([1] + spm_tok.encode("Hi", add_special=False), render_special=True) == "<s> Hi"


def test_random_bytes_and_long_runs(smol, spm_tok):
    import random

    rng = random.Random(1234)
    alphabet = b" \t\n\r'0123456789aZ.,<|>" + "é東🙂\u0301".encode()
    for _ in range(200):
        raw = bytes(rng.choice(alphabet) if rng.random() < 0.8 else rng.randrange(256) for _ in range(rng.randrange(40)))
        for tok in (smol, spm_tok):
            ids = tok.encode(raw, parse_special=True)
            want = tok.decode(ids, render_special=True)
            d = tok.detokenizer(render_special=True)
            assert "".join(d.push(i) for i in ids) + d.flush() == want
    long = " " * 50_000 + "x" + "\n" * 10_000 + "9" * 10_000
    assert smol.decode(smol.encode(long)) == long
    assert spm_tok.decode(spm_tok.encode(long)) == long
