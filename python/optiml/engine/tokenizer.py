"""Text <-> token ids with the tokenizer stored in a GGUF file (native, as llama.cpp reads it).

    tok = optiml.tokenizer.load("model.gguf")
    ids = tok.encode("Hello", add_special=True, parse_special=False)
    text = tok.decode(ids)
    stream = tok.detokenizer()            # for generation: feed ids, get complete UTF-8 back
    for i in ids: print(stream.push(i), end="")

Byte-level BPE (``tokenizer.ggml.model`` = gpt2, with the pre-tokenizer named by
``tokenizer.ggml.pre``) and SentencePiece (``llama``) are supported; others raise
optiml.UnsupportedModelError naming what is.
"""

from __future__ import annotations

import os
from typing import Iterable

from .. import _core
from .._core import ArgumentError
from .checks import boolean, token_id

__all__ = ["Detokenizer", "Tokenizer", "load"]

_INT32 = (-(2**31), 2**31 - 1)


def _id(i) -> int:
    """A token id as the native side takes it (an int32); a float or a bool is refused, as eval and prompts
    refuse them, rather than truncated into another token."""
    i = token_id(i)
    if not _INT32[0] <= i <= _INT32[1]:
        raise ArgumentError(f"token id {i} is outside the vocabulary")
    return i


def _ids(ids: Iterable[int]) -> list[int]:
    return [_id(i) for i in ids]


class Tokenizer:
    """A GGUF file's tokenizer. Methods are thread-safe; encode releases the GIL on long texts."""

    def __init__(self, native: _core.Tokenizer, path: str | None = None):
        self._t = native
        self.path = path

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        p = os.fspath(path)
        if not os.path.exists(p):
            raise FileNotFoundError(f"no such file: {p}")
        if os.path.isdir(p):  # (the native reader would say only "Is a directory", as a RuntimeError)
            raise ArgumentError(f"{p} is a folder: give a GGUF file (convert a Hugging Face folder with "
                                "optiml convert)")
        return cls(_core.Tokenizer(os.fsencode(p)), p)

    @classmethod
    def from_gguf(cls, f) -> Tokenizer:
        """From an open optiml.gguf.GGUFFile."""
        return cls(_core.Tokenizer.from_gguf(f._f), f.path)

    def encode(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``. add_special: BOS/EOS as the file asks (tokenizer.ggml.add_bos_token,
        add_eos_token). parse_special: text like "<|im_start|>" becomes that control token. A str with lone
        surrogates (bytes that were not UTF-8, as Python decodes a command line or stdin) is tokenized as the
        original bytes are. Bytes that are not UTF-8 are read as llama.cpp reads them: for a byte-level BPE
        vocabulary each byte that starts no complete sequence is U+FFFD, for SentencePiece one byte token each."""
        if not isinstance(text, (str, bytes)):
            raise ArgumentError(f"the text to tokenize must be a str or bytes, not {type(text).__name__}")
        add_special, parse_special = boolean("add_special", add_special), boolean("parse_special", parse_special)
        try:
            return self._t.encode(text, add_special, parse_special)
        except UnicodeEncodeError:
            return self._t.encode(_undecoded(text), add_special, parse_special)

    def pre_tokenize(self, text: str) -> list[bytes]:
        """The pieces the pre-tokenizer splits ``text`` into before BPE (for debugging)."""
        return self._t.pre_tokenize(text)

    def decode(self, ids: Iterable[int], render_special: bool = False, errors: str = "replace") -> str:
        """Text of the ids; control tokens (BOS, <|im_end|>, ...) are left out unless render_special."""
        return self._t.decode(_ids(ids), boolean("render_special", render_special)).decode("utf-8", errors)

    def decode_bytes(self, ids: Iterable[int], render_special: bool = False) -> bytes:
        return self._t.decode(_ids(ids), boolean("render_special", render_special))

    def token_to_piece(self, id: int, render_special: bool = True) -> bytes:
        """The bytes one token stands for (possibly part of a UTF-8 character)."""
        return self._t.token_to_piece(_id(id), boolean("render_special", render_special))

    def token_text(self, id: int) -> bytes:
        """The token as stored in the file (GPT-2 byte alphabet / U+2581 for spaces)."""
        return self._t.token_text(_id(id))

    def token_id(self, text: str) -> int:
        """Id of the token stored with exactly this text, -1 if none."""
        return self._t.token_id(text)

    def token_type(self, id: int) -> int:
        """1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
        return self._t.token_type(_id(id))

    def is_eog(self, id: int) -> bool:
        return self._t.is_eog(_id(id))

    def is_control(self, id: int) -> bool:
        return self._t.is_control(_id(id))

    def detokenizer(self, render_special: bool = False) -> Detokenizer:
        return Detokenizer(self, render_special)

    n_vocab = property(lambda self: self._t.n_vocab)
    bos_id = property(lambda self: self._t.bos_id, doc="-1 when absent")
    eos_id = property(lambda self: self._t.eos_id, doc="-1 when absent")
    eot_id = property(lambda self: self._t.eot_id, doc="-1 when absent")
    unk_id = property(lambda self: self._t.unk_id, doc="-1 when absent")
    pad_id = property(lambda self: self._t.pad_id, doc="-1 when absent")
    eog_ids = property(lambda self: list(self._t.eog_ids))
    add_bos = property(lambda self: self._t.add_bos)
    add_eos = property(lambda self: self._t.add_eos)
    model_name = property(lambda self: self._t.model_name, doc='"gpt2" or "llama"')
    pre_name = property(lambda self: self._t.pre_name, doc="tokenizer.ggml.pre (BPE)")

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        pre = f"/{self.pre_name}" if self.pre_name else ""
        return f"<optiml.tokenizer.Tokenizer {self.model_name}{pre}, {self.n_vocab} tokens>"


class Detokenizer:
    """Streams text from ids: push() returns only complete UTF-8, holding back a character cut
    between tokens; flush() returns what is left (a cut-off character as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, render_special: bool = False):
        self._d = _core.Detokenizer(tokenizer._t, boolean("render_special", render_special))

    def push(self, id: int) -> str:
        return self._d.push(_id(id))

    def flush(self) -> str:
        return self._d.flush()

    def reset(self) -> None:
        self._d.reset()

    @property
    def pending_bytes(self) -> int:
        return self._d.pending_bytes


def load(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of the GGUF file at ``path``."""
    return Tokenizer.from_file(path)


def _undecoded(text: str) -> bytes:
    """The bytes of a str that holds lone surrogates: the original bytes where they came from surrogateescape
    (sys.argv, stdin, os.fsdecode), U+FFFD for any other."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
