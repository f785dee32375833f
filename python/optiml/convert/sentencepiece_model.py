"""Reads a SentencePiece tokenizer.model (a ModelProto protobuf) without the protobuf or sentencepiece
packages: only the fields llama.cpp's converter uses (pieces with score and type, the trainer's model
type and special ids, the normalizer's add_dummy_prefix)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .errors import ConvertError


@dataclass
class Piece:
    piece: str
    score: float = 0.0
    type: int = 1  # NORMAL=1 UNKNOWN=2 CONTROL=3 USER_DEFINED=4 UNUSED=5 BYTE=6 (gguf uses the same)


@dataclass
class SPModel:
    pieces: list = field(default_factory=list)
    model_type: int = 1  # trainer_spec.model_type: UNIGRAM=1 BPE=2 WORD=3 CHAR=4
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    add_dummy_prefix: bool = True


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(b):
            raise ValueError("truncated varint")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(b: bytes):
    """(field number, wire type, value) of one message; length-delimited values come back as bytes."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 1:
            v, i = b[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(b, i)
            if i + n > len(b):
                raise ValueError("truncated field")
            v, i = b[i:i + n], i + n
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported wire type {wt}")
        yield num, wt, v


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v  # int32 fields encode negatives as 10-byte varints


def load(path: str) -> SPModel:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConvertError(f"{path}: cannot read: {e.strerror or e}") from None
    m = SPModel()
    try:
        for num, wt, v in _fields(data):
            if num == 1 and wt == 2:  # pieces
                p = Piece("")
                for n2, w2, v2 in _fields(v):
                    if n2 == 1 and w2 == 2:
                        p.piece = v2.decode("utf-8")
                    elif n2 == 2 and w2 == 5:
                        p.score = struct.unpack("<f", v2)[0]
                    elif n2 == 3 and w2 == 0:
                        p.type = v2
                m.pieces.append(p)
            elif num == 2 and wt == 2:  # trainer_spec
                for n2, w2, v2 in _fields(v):
                    if w2 != 0:
                        continue
                    if n2 == 3:
                        m.model_type = v2
                    elif n2 == 40:
                        m.unk_id = _signed(v2)
                    elif n2 == 41:
                        m.bos_id = _signed(v2)
                    elif n2 == 42:
                        m.eos_id = _signed(v2)
                    elif n2 == 43:
                        m.pad_id = _signed(v2)
            elif num == 3 and wt == 2:  # normalizer_spec
                for n2, w2, v2 in _fields(v):
                    if n2 == 3 and w2 == 0:
                        m.add_dummy_prefix = bool(v2)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not a SentencePiece model: {e}") from None
    if not m.pieces:
        raise ConvertError(f"{path}: not a SentencePiece model (no pieces)")
    return m
