"""optiml.gguf against gguf-py (GGUFWriter / GGUFReader) as the independent oracle, plus crafted
malformed files and truncation / byte-flip robustness on the real SmolLM2 file."""

import os
import random
import resource
import struct

import gguf
import numpy as np
import pytest

import optiml
from optiml import gguf as og

from hf_gguf import write_and_close

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

SCALAR_FMT = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
    VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
    VT.FLOAT64: "<d",
}
NP_DTYPE = {
    VT.UINT8: np.uint8, VT.INT8: np.int8, VT.UINT16: np.uint16, VT.INT16: np.int16,
    VT.UINT32: np.uint32, VT.INT32: np.int32, VT.FLOAT32: np.float32, VT.BOOL: np.bool_,
    VT.UINT64: np.uint64, VT.INT64: np.int64, VT.FLOAT64: np.float64,
}


# ---- a tiny GGUF byte builder, for files GGUFWriter cannot or will not write -------------------

def enc_str(s) -> bytes:
    b = s.encode() if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def enc_value(vtype, value) -> bytes:
    """value for ARRAY is (element_type, [elements])."""
    if vtype == VT.STRING:
        return enc_str(value)
    if vtype == VT.ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(enc_value(etype, v) for v in items)
    return struct.pack(SCALAR_FMT[vtype], value)


def enc_kv(key, vtype, value) -> bytes:
    return enc_str(key) + struct.pack("<I", vtype) + enc_value(vtype, value)


def enc_tensor(name, ne, ttype, offset) -> bytes:
    return (enc_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
            + struct.pack("<IQ", ttype, offset))


def build(kvs=(), tensors=(), data=b"", alignment=32, version=3, n_kv=None, n_tensors=None,
          raw_kv=b"", raw_ti=b"") -> bytes:
    """kvs: (key, vtype, value); tensors: (name, ne, type, offset). Data follows, aligned."""
    body = b"".join(enc_kv(*kv) for kv in kvs) + raw_kv
    body += b"".join(enc_tensor(*t) for t in tensors) + raw_ti
    head = b"GGUF" + struct.pack("<IQQ", version,
                                 len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    out = head + body
    if tensors or data:
        out += b"\0" * (-len(out) % alignment)
    return out + data


def write(tmp_path, blob, name="t.gguf"):
    p = tmp_path / name
    p.write_bytes(blob)
    return p


def expect_error(path, *words):
    with pytest.raises(optiml.GGUFError) as ei:
        og.open(path)
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


# ---- comparison with GGUFReader ----------------------------------------------------------------

def reader_value(field):
    """A GGUFReader field as optiml.gguf returns it (flat arrays only)."""
    main = field.types[0]
    if main == VT.ARRAY:
        sub = field.types[-1] if len(field.types) > 1 else None
        if sub == VT.STRING:
            return field.contents()
        dtype = NP_DTYPE[sub] if sub is not None else np.uint8
        return np.array(field.contents(), dtype=dtype)
    if main == VT.STRING:
        return field.contents()
    return field.contents()


def assert_same_value(ours, theirs, key):
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), key
        assert ours.dtype == theirs.dtype, key
        np.testing.assert_array_equal(ours, theirs, err_msg=key)
    elif isinstance(theirs, float):
        assert isinstance(ours, float), key
        assert ours == theirs or (np.isnan(ours) and np.isnan(theirs)), key
    else:
        assert type(ours) is type(theirs) and ours == theirs, key


def assert_matches_reader(f, reader, skip_nested=()):
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(fields)
    for key, field in fields.items():
        assert f.metadata_types[key].split("[")[0] == field.types[0].name.lower(), key
        if key in skip_nested:
            continue
        assert_same_value(f.metadata[key], reader_value(field), key)
    assert len(f.tensors) == len(reader.tensors)
    for ours, rt in zip(f.tensors, reader.tensors):
        assert ours.name == rt.name
        assert ours.type == int(rt.tensor_type)
        assert ours.type_name == rt.tensor_type.name
        assert ours.shape == tuple(int(x) for x in rt.shape)
        assert ours.n_elements == int(rt.n_elements)
        assert ours.n_bytes == int(rt.n_bytes)
        assert ours.offset == int(rt.data_offset)
        data = f.tensor_data(ours.name)
        assert data.dtype == np.uint8 and not data.flags.writeable
        assert data.shape == (int(np.prod(ours.shape[1:])), ours.n_bytes // max(1, int(np.prod(ours.shape[1:]))))
        assert data.tobytes() == np.asarray(rt.data).tobytes()


# ---- files written by GGUFWriter -----------------------------------------------------------------

NESTED = [[1, 2, 3], [4, 5], [6]]
NESTED_STR = [["a", "bc"], ["déf"]]


def write_with_gguf_py(path, alignment=None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="testarch")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 1.5e-3)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", -2.718281828459045)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo wörld ✓")
    w.add_key_value("t.empty_str", "", VT.STRING)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.25, 3.0e10])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_array("t.arr_str", ["a", "", "ü", "longer string"])
    for vt in (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.UINT64, VT.INT64, VT.FLOAT64):
        w.add_key_value(f"t.arr_{vt.name.lower()}", [1, 2, 3], VT.ARRAY, sub_type=vt)
    w.add_array("t.nested", NESTED)
    w.add_array("t.nested_str", NESTED_STR)
    w.add_tensor("f32_2d", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16_3d", rng.standard_normal((2, 3, 4)).astype(np.float16))
    q8 = rng.integers(0, 256, size=(4, 2 * 34), dtype=np.uint8)  # 4 rows of 64 Q8_0 elements
    w.add_tensor("q8_0", q8, raw_dtype=QT.Q8_0)
    w.add_tensor("i32_1d", np.arange(5, dtype=np.int32))
    w.add_tensor("f64_4d", rng.standard_normal((2, 1, 2, 3)).astype(np.float64))
    write_and_close(w)


@pytest.mark.parametrize("alignment", [None, 64, 4096])
def test_gguf_py_written_file_matches_reader(tmp_path, alignment):
    path = tmp_path / "w.gguf"
    write_with_gguf_py(path, alignment)
    reader = gguf.GGUFReader(str(path))
    with og.open(path) as f:
        assert f.version == 3
        assert f.alignment == (alignment or 32)
        assert f.data_offset % f.alignment == 0
        assert f.tensors[0].offset == f.data_offset
        assert_matches_reader(f, reader, skip_nested=("t.nested", "t.nested_str"))
        md = f.metadata
        assert md["t.u64"] == 2**64 - 1 and md["t.i64"] == -(2**63)
        assert md["t.f32"] == float(np.float32(1.5e-3))
        assert md["t.true"] is True and md["t.false"] is False
        assert md["t.empty_str"] == ""
        assert md["t.arr_str"] == ["a", "", "ü", "longer string"]
        assert md["t.arr_bool"].dtype == np.bool_
        assert md["t.arr_uint64"].dtype == np.uint64
        # gguf-py's reader flattens nested arrays; compare those with what was written.
        assert [list(a) for a in md["t.nested"]] == NESTED
        assert all(a.dtype == np.int32 for a in md["t.nested"])
        assert md["t.nested_str"] == NESTED_STR
        assert f.metadata_types["t.nested"] == "array[array]"
        assert f.metadata_types["t.arr_str"] == "array[string]"
        assert f.metadata_types["t.u32"] == "uint32"
        assert f.tensor("q8_0").shape == (64, 4) and f.tensor("q8_0").type_name == "Q8_0"
        assert f.tensor_data("q8_0").shape == (4, 68)
        f32 = f.tensor_data("f32_2d").view(np.float32)
        assert f32.shape == (3, 8)


def test_typed_getters(tmp_path):
    path = tmp_path / "w.gguf"
    write_with_gguf_py(path)
    f = og.open(path)._f
    assert f.get("u32", "t.u16") == 65535
    assert f.get("u64", "t.u64") == 2**64 - 1
    assert f.get("i32", "t.i8") == -128
    assert f.get("i64", "t.i64") == -(2**63)
    assert f.get("f32", "t.f32") == pytest.approx(1.5e-3)
    assert f.get("f64", "t.f64") == -2.718281828459045
    assert f.get("bool", "t.true") is True
    assert f.get("string", "t.str") == "héllo wörld ✓"
    assert f.get("string_array", "t.arr_str") == [b"a", b"", "ü".encode(), b"longer string"]
    assert f.get("f32_array", "t.arr_f32") == pytest.approx([0.5, -1.25, 3.0e10])
    assert f.get("i32_array", "t.arr_i32") == [1, -2, 3]
    assert f.get("u32_array", "t.arr_uint8") == [1, 2, 3]
    for kind, key, words in [
        ("u32", "t.missing", "missing metadata key 't.missing'"),
        ("u32", "t.i8", "does not fit"),  # -128
        ("u32", "t.u64", "does not fit"),
        ("i64", "t.u64", "does not fit"),
        ("f32", "t.u32", "expected a float"),
        ("string", "t.u8", "expected a string"),
        ("bool", "t.u8", "expected a bool"),
        ("u32", "t.str", "expected an integer"),
        ("string_array", "t.arr_i32", "expected strings"),
        ("i32_array", "t.arr_f32", "expected integers"),
        ("u32_array", "t.arr_i32", "does not fit"),
        ("f32_array", "t.u32", "expected an array"),
    ]:
        with pytest.raises(optiml.GGUFError, match=words):
            f.get(kind, key)
    with pytest.raises(optiml.ArgumentError):
        f.get("nonsense", "t.u32")


def crafted_every_type() -> bytes:
    """Empty arrays, empty nested arrays and non-UTF-8 strings, which GGUFWriter will not write."""
    kvs = [
        ("general.alignment", VT.UINT32, 16),
        ("e.empty_u8", VT.ARRAY, (VT.UINT8, [])),
        ("e.empty_str_arr", VT.ARRAY, (VT.STRING, [])),
        ("e.empty_nested", VT.ARRAY, (VT.ARRAY, [])),
        ("e.empty_str", VT.STRING, ""),
        ("e.nested", VT.ARRAY, (VT.ARRAY, [(VT.FLOAT64, [1.5]), (VT.BOOL, []), (VT.STRING, ["x"]),
                                           (VT.ARRAY, [(VT.INT16, [-7, 7])])])),
        ("e.bytes", VT.STRING, b"\xff\xfe ok"),
        ("e.str_arr_bytes", VT.ARRAY, (VT.STRING, [b"ok", b"\xc3"])),
    ]
    for vt in SCALAR_FMT:
        kvs.append((f"s.{vt.name.lower()}", vt, True if vt == VT.BOOL else 1))
    data = np.arange(16, dtype=np.float32).tobytes()
    return build(kvs, [("a", [4], QT.F32, 0), ("b", [4, 3], QT.F32, 16)], data, alignment=16)


def test_crafted_file_every_type_matches_reader(tmp_path):
    blob = crafted_every_type()
    path = write(tmp_path, blob)
    reader = gguf.GGUFReader(str(path))
    f = og.open(path)
    assert f.alignment == 16
    # GGUFReader records no element type for empty arrays and cannot decode non-UTF-8 strings.
    skip = ("e.nested", "e.bytes", "e.str_arr_bytes", "e.empty_nested", "e.empty_str_arr")
    assert_matches_reader(f, reader, skip_nested=skip)
    md = f.metadata
    assert md["e.empty_u8"].dtype == np.uint8 and md["e.empty_u8"].size == 0
    assert md["e.empty_str_arr"] == [] and md["e.empty_nested"] == [] and md["e.empty_str"] == ""
    n = md["e.nested"]
    assert n[0].dtype == np.float64 and list(n[0]) == [1.5]
    assert n[1].dtype == np.bool_ and n[1].size == 0
    assert n[2] == ["x"] and n[3][0].dtype == np.int16 and list(n[3][0]) == [-7, 7]
    assert md["e.bytes"] == b"\xff\xfe ok"
    assert md["e.str_arr_bytes"] == ["ok", b"\xc3"]
    assert f.metadata_types["e.nested"] == "array[array]"
    np.testing.assert_array_equal(f.tensor_data("b").view(np.float32).ravel(), np.arange(4, 16))


def test_version_2_reads_and_others_rejected(tmp_path):
    path = tmp_path / "w.gguf"
    write_with_gguf_py(path)
    blob = bytearray(path.read_bytes())
    v3 = og.open(path)
    blob[4:8] = struct.pack("<I", 2)
    v2 = og.open(write(tmp_path, bytes(blob), "v2.gguf"))
    assert v2.version == 2
    assert v2.tensors == v3.tensors
    assert list(v2.metadata) == list(v3.metadata)
    blob[4:8] = struct.pack("<I", 1)
    expect_error(write(tmp_path, bytes(blob), "v1.gguf"), "unsupported GGUF version 1")
    blob[4:8] = struct.pack("<I", 4)
    expect_error(write(tmp_path, bytes(blob), "v4.gguf"), "unsupported GGUF version 4")
    blob[4:8] = struct.pack(">I", 3)
    expect_error(write(tmp_path, bytes(blob), "be.gguf"), "big-endian GGUF files are not supported")


def test_views_outlive_close_and_open_errors(tmp_path):
    path = tmp_path / "w.gguf"
    write_with_gguf_py(path)
    with og.open(path) as f:
        view = f.tensor_data("i32_1d")
        assert "w.gguf" in repr(f) and "5 tensors" in f.summary()
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            f.tensor_data("nope")
        with pytest.raises(optiml.GGUFError):
            f.tensor("nope")
    del f
    np.testing.assert_array_equal(view.view(np.int32).ravel(), np.arange(5))
    with pytest.raises(ValueError):
        view[0, 0] = 1
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        og.open(tmp_path / "missing.gguf")
    with pytest.raises(IsADirectoryError):
        og.open(tmp_path)
    expect_error(write(tmp_path, b"", "empty.gguf"), "truncated")


# ---- crafted malformed files ---------------------------------------------------------------------

F32_4 = ("w", [4], QT.F32, 0)
BIG = 2**63

BAD_FILES = {
    "magic": (lambda: b"GGUX" + build()[4:], ["bad magic 'GGUX'"]),
    "truncated_header": (lambda: build()[:20], ["truncated", "metadata count"]),
    "n_tensors_huge": (lambda: build(n_tensors=BIG), ["tensor count 9223372036854775808"]),
    "n_kv_huge": (lambda: build(n_kv=2**40), ["metadata count 1099511627776"]),
    "n_kv_too_many": (lambda: build([("a", VT.UINT8, 1)], n_kv=2), ["metadata count 2 cannot fit"]),
    "key_length_huge": (lambda: build(n_kv=1, raw_kv=struct.pack("<Q", BIG) + b"x" * 16),
                        ["string length 9223372036854775808", "key of metadata entry 0"]),
    "value_length_huge": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<IQ", VT.STRING, 2**62)),
                          ["metadata key 'k'", "string length"]),
    "array_length_huge": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<IIQ", VT.ARRAY, VT.UINT32, 2**61)),
                          ["metadata key 'k'", "array", "length 2305843009213693952"]),
    "string_array_length_huge": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 10**6)),
                                 ["length 1000000"]),
    "unknown_value_type": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<IB", 13, 0) + b"\0" * 16),
                           ["metadata key 'k'", "unknown value type 13"]),
    "unknown_array_type": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<IIQ", VT.ARRAY, 99, 0)),
                           ["unknown value type 99"]),
    "bad_bool": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<IB", VT.BOOL, 2) + b"\0" * 16),
                 ["metadata key 'k'", "bool"]),
    "deep_nesting": (lambda: build(n_kv=1, raw_kv=enc_str("k") + struct.pack("<I", VT.ARRAY)
                                   + struct.pack("<IQ", VT.ARRAY, 1) * 100 + b"\0" * 64),
                     ["nested"]),
    "key_not_utf8": (lambda: build([(b"k\xff", VT.UINT8, 1)]), ["UTF-8", "'k\\xff'"]),
    "duplicate_key": (lambda: build([("k", VT.UINT8, 1), ("k", VT.UINT16, 2)]), ["duplicate metadata key 'k'"]),
    "unknown_tensor_type": (lambda: build(tensors=[("w", [32], 4, 0)], data=b"\0" * 64), ["tensor 'w'", "unknown tensor type 4"]),
    "tensor_type_huge": (lambda: build(tensors=[("w", [32], 2**31 + 1, 0)], data=b"\0" * 64), ["unknown tensor type"]),
    "n_dims_5": (lambda: build(tensors=[("w", [1, 1, 1, 1, 1], QT.F32, 0)], data=b"\0" * 32), ["tensor 'w'", "n_dims 5"]),
    "n_dims_0": (lambda: build(tensors=[("w", [], QT.F32, 0)], data=b"\0" * 32), ["n_dims 0"]),
    "negative_dim": (lambda: build(tensors=[("w", [4, 2**64 - 1], QT.F32, 0)], data=b"\0" * 32), ["negative dimension"]),
    "element_overflow": (lambda: build(tensors=[("w", [2**32, 2**32], QT.F32, 0)], data=b"\0" * 32), ["overflows"]),
    "row_size_overflow": (lambda: build(tensors=[("w", [2**62], QT.F64, 0)], data=b"\0" * 32), ["byte size overflows"]),
    "byte_size_overflow": (lambda: build(tensors=[("w", [2**40, 2**22], QT.F64, 0)], data=b"\0" * 32), ["byte size overflows"]),
    "block_size": (lambda: build(tensors=[("w", [33, 2], QT.Q8_0, 0)], data=b"\0" * 128), ["tensor 'w'", "block size 32"]),
    "misaligned_offset": (lambda: build(tensors=[F32_4, ("v", [4], QT.F32, 48)], data=b"\0" * 96), ["tensor 'v'", "alignment 32"]),
    "alignment_0": (lambda: build([("general.alignment", VT.UINT32, 0)]), ["general.alignment 0 is not a power of two"]),
    "alignment_3": (lambda: build([("general.alignment", VT.UINT32, 3)]), ["general.alignment 3 is not a power of two"]),
    "alignment_type": (lambda: build([("general.alignment", VT.UINT64, 32)]), ["general.alignment must be a uint32"]),
    "overlap": (lambda: build(tensors=[("a", [16], QT.F32, 0), ("b", [8], QT.F32, 32)], data=b"\0" * 96),
                ["tensors 'a' and 'b' overlap"]),
    "past_eof": (lambda: build(tensors=[("a", [16], QT.F32, 0)], data=b"\0" * 63), ["tensor 'a'", "past the end of the file"]),
    "offset_huge": (lambda: build(tensors=[("a", [8], QT.F32, 2**64 - 32)], data=b"\0" * 32), ["past the end of the file"]),
    "duplicate_tensor": (lambda: build(tensors=[F32_4, ("w", [4], QT.F32, 32)], data=b"\0" * 64), ["duplicate tensor 'w'"]),
    "tensor_name_huge": (lambda: build(n_tensors=1, raw_ti=struct.pack("<Q", 2**40) + b"\0" * 40), ["name of tensor 0", "string length"]),
    "truncated_tensor_info": (lambda: build(n_tensors=1, raw_ti=enc_tensor("w", [4, 4], QT.F32, 0)[:-6]),
                              ["truncated", "tensor 'w'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file(tmp_path, case):
    make, words = BAD_FILES[case]
    path = write(tmp_path, make(), f"{case}.gguf")
    msg = expect_error(path, *words)
    assert msg.startswith(str(path))


def test_name_quoting_in_messages(tmp_path):
    # Names from damaged files end up in messages escaped and cut short, never as raw bytes.
    name = "x" * 300 + "\x01"
    msg = expect_error(write(tmp_path, build(tensors=[(name, [3], 999, 0)])), "unknown tensor type 999")
    assert "\x01" not in msg and "..." in msg and len(msg) < 400 + len(str(tmp_path))


def test_crafted_file_every_truncation_and_flip(tmp_path):
    # Every prefix, and every byte xor-ed with a few patterns, of a file dense in structure.
    blob = crafted_every_type()
    path = tmp_path / "fuzz.gguf"
    for n in range(len(blob)):
        path.write_bytes(blob[:n])
        with pytest.raises(optiml.GGUFError):
            og.open(path)
    opened = 0
    for pos in range(len(blob) - 64):  # the header, not the tensor data
        for x in (0x01, 0x80, 0xFF):
            b = bytearray(blob)
            b[pos] ^= x
            path.write_bytes(b)
            try:
                og.open(path)
                opened += 1
            except optiml.GGUFError:
                pass
    assert opened > 0


# ---- the real SmolLM2 file -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_reader(smollm2_path):
    return gguf.GGUFReader(str(smollm2_path))


def test_smollm2_matches_gguf_py(smollm2_path, smollm2_reader):
    with og.open(smollm2_path) as f:
        assert f.version == 3 and f.alignment == 32
        assert f.file_size == os.path.getsize(smollm2_path)
        assert_matches_reader(f, smollm2_reader)
        counts = {}
        for t in f.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        assert len(f.tensors) == 272 and counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
        assert f.metadata["general.architecture"] == "llama"
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
        emb = f.tensor("token_embd.weight")
        assert emb.shape == (576, 49152) and f.tensor_data(emb.name).shape == (49152, 612)


@pytest.fixture(scope="module")
def smollm2_header(smollm2_path):
    with og.open(smollm2_path) as f:
        n_header = f.data_offset
        size = f.file_size
    with open(smollm2_path, "rb") as fp:
        return fp.read(n_header), size


def sparse_copy(path, header, size):
    """The header bytes, then zeros (a sparse hole) up to the real size: only the header is parsed."""
    path.write_bytes(header)
    os.truncate(path, size)


def test_smollm2_truncated_everywhere(tmp_path, smollm2_header):
    header, size = smollm2_header
    rng = random.Random(1234)
    lengths = set(range(0, 4096, 3))
    lengths |= {rng.randrange(4096, len(header)) for _ in range(300)}
    lengths |= {len(header) - k for k in range(1, 40)}  # inside the last tensor info and padding
    lengths |= {rng.randrange(len(header), size) for _ in range(40)}
    lengths |= {size - 1}
    path = tmp_path / "trunc.gguf"
    sparse_copy(path, header, size)
    og.open(path)  # the untruncated sparse copy is valid
    # Cutting longest first keeps every shorter file a prefix of the original.
    for n in sorted(lengths, reverse=True):
        os.truncate(path, n)
        with pytest.raises(optiml.GGUFError):
            og.open(path)


def test_smollm2_byte_flips(tmp_path, smollm2_header):
    header, size = smollm2_header
    rng = random.Random(99)
    n_header = len(header)
    positions = [rng.randrange(0, 2048) for _ in range(150)]  # counts, small keys and values
    positions += [rng.randrange(n_header - 16384, n_header) for _ in range(200)]  # tensor infos
    positions += [rng.randrange(0, n_header) for _ in range(150)]
    path = tmp_path / "flip.gguf"
    sparse_copy(path, header, size)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"ok": 0, "error": 0}
    with open(path, "r+b") as fp:
        for pos in positions:
            flipped = header[pos] ^ rng.randrange(1, 256)
            fp.seek(pos)
            fp.write(bytes([flipped]))
            fp.flush()
            try:
                with og.open(path) as f:
                    assert len(f.tensors) <= 272
                outcomes["ok"] += 1
            except optiml.GGUFError:
                outcomes["error"] += 1
            fp.seek(pos)
            fp.write(header[pos:pos + 1])
    fp_growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert fp_growth_kb < 512 * 1024
    assert outcomes["error"] > 50 and outcomes["ok"] > 0
