"""optiml.convert on what the happy path does not meet: named chat templates (written as llama.cpp's converter
writes them), JSON nested too deeply, a full disk, corrupt sizes in config.json, a Hugging Face cache snapshot's
model name."""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402

import optiml  # noqa: E402
from optiml import cli  # noqa: E402
from optiml.convert import ConvertError, convert  # noqa: E402
from optiml.engine.chat_template import read_template  # noqa: E402

from test_convert import good, make_model, save_folder, tiny_tokenizer  # noqa: E402, F401 (fixtures)


def fields(path):
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


# ---- named chat templates ---------------------------------------------------------------------------
TEMPLATES = {
    "default": "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}",
    "tool_use": "{{ tools }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "rag-v2": "{{ documents }}{% for m in messages %}{{ m['content'] }}{% endfor %}",  # "-": a key of "_"
}


@pytest.mark.parametrize("form", ["jinja-files", "tokenizer-config-list"])
def test_named_chat_templates_are_written_as_llama_cpp_writes_them(tmp_path, tiny_tokenizer, form):
    """transformers 5 saves several templates as chat_template.jinja + additional_chat_templates/NAME.jinja, older
    ones as a list in tokenizer_config.json: both give what gguf-py's SpecialVocab + GGUFWriter (llama.cpp's
    converter) write, the default as tokenizer.chat_template, the others as tokenizer.chat_template.NAME listed in
    tokenizer.chat_templates."""
    d = save_folder(make_model("llama-gqa-tied"), tmp_path / "hf", tiny_tokenizer)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = dict(TEMPLATES)
    tok.save_pretrained(d, save_jinja_files=form == "jinja-files")
    if form == "jinja-files":
        assert sorted(os.listdir(d / "additional_chat_templates")) == ["rag-v2.jinja", "tool_use.jinja"]
    else:
        assert isinstance(json.loads((d / "tokenizer_config.json").read_text())["chat_template"], list)

    ref = tmp_path / "ref.gguf"  # what llama.cpp's converter writes for these files
    w = gguf.GGUFWriter(ref, "llama")
    gguf.SpecialVocab(d, load_merges=False).add_to_gguf(w, quiet=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    want = {k: v for k, v in fields(ref).items() if k.startswith("tokenizer.chat_template")}

    out = convert(d, tmp_path / "m.gguf", type="q8_0")
    got = {k: v for k, v in fields(out).items() if k.startswith("tokenizer.chat_template")}
    assert sorted(got.pop("tokenizer.chat_templates")) == sorted(want.pop("tokenizer.chat_templates")) == \
        ["rag_v2", "tool_use"]
    assert got == want == {"tokenizer.chat_template": TEMPLATES["default"],
                           "tokenizer.chat_template.tool_use": TEMPLATES["tool_use"],
                           "tokenizer.chat_template.rag_v2": TEMPLATES["rag-v2"]}
    assert read_template(out) == TEMPLATES["default"]  # (the one OptiML's chat uses)
    with optiml.Model(out, n_threads=1) as m:  # (the native reader takes the new keys)
        assert m.hparams["arch"] == "llama"


def test_one_chat_template_writes_no_list(good, tmp_path):
    """A single template (transformers' chat_template.jinja) is tokenizer.chat_template alone, as before."""
    (good / "chat_template.jinja").write_text(TEMPLATES["default"])
    f = fields(convert(good, tmp_path / "m.gguf", type="q8_0"))
    assert f["tokenizer.chat_template"] == TEMPLATES["default"]
    assert not [k for k in f if k.startswith("tokenizer.chat_template") and k != "tokenizer.chat_template"]


def test_named_jinja_files_keep_the_configs_default(good, tmp_path):
    """Named templates in additional_chat_templates/ beside a default kept in tokenizer_config.json (no
    chat_template.jinja): the default is the config's, the named ones the files'."""
    cfg = json.loads((good / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATES["default"]
    (good / "tokenizer_config.json").write_text(json.dumps(cfg))
    (good / "additional_chat_templates").mkdir()
    (good / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATES["tool_use"])
    f = fields(convert(good, tmp_path / "m.gguf", type="q8_0"))
    assert f["tokenizer.chat_template"] == TEMPLATES["default"]
    assert f["tokenizer.chat_template.tool_use"] == TEMPLATES["tool_use"] and f["tokenizer.chat_templates"] == ["tool_use"]


# ---- JSON nested too deeply -----------------------------------------------------------------------
DEEP = "[" * 100000 + "]" * 100000  # json.load recurses once per level: RecursionError, not a decoding error


def _nest_deeply(d, name):
    if name == "model.safetensors":  # the header
        raw = (d / name).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        (d / name).write_bytes(len(DEEP).to_bytes(8, "little") + DEEP.encode() + raw[8 + n:])
    else:  # (an index makes the shards' list come from it)
        (d / name).write_text(DEEP)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
                                  "model.safetensors.index.json"])
def test_json_nested_too_deeply_is_a_convert_error(good, tmp_path, name):
    _nest_deeply(good, name)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(ConvertError, match=f"{good / name}: .*nested too deeply"):
        convert(good, out, type="q8_0")
    assert os.listdir(out.parent) == []


# ---- a write that fails -----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["write", "close"])
def test_a_full_disk_names_the_output_and_leaves_nothing(good, tmp_path, monkeypatch, where):
    """ENOSPC while writing a tensor, or only when the last buffered bytes are flushed: a ConvertError that names
    the output (not the temporary file) and says what to do; the earlier file stays, no temporary is left."""
    calls = []
    if where == "write":
        real = gguf.GGUFWriter.write_tensor_data

        def failing(self, *a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, *a, **k)

        monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    else:
        real = gguf.GGUFWriter.close

        def failing(self):
            real(self)
            if not calls:  # (the first close, which flushes; a failure is closed again, quietly)
                calls.append(1)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(gguf.GGUFWriter, "close", failing)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(b"old")
    with pytest.raises(ConvertError) as e:
        convert(good, out, type="q8_0")
    msg = str(e.value)
    assert msg.startswith(f"{out}: cannot write the GGUF file: {os.strerror(errno.ENOSPC)}")
    assert "free space there" in msg and f"in {out.parent}" in msg and ".tmp" not in msg
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(out.parent) == ["m.gguf"] and out.read_bytes() == b"old"


def test_a_file_size_limit_is_a_convert_error(good, tmp_path):
    """A real failed write: the file-size limit (ulimit -f) below the file's size, in a child process (with
    SIGXFSZ ignored a write past it fails with EFBIG)."""
    resource = pytest.importorskip("resource")  # (POSIX)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "from optiml.convert import ConvertError, convert\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        "    convert(sys.argv[1], sys.argv[2], type='f32')\n"
        "except ConvertError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    if hard != resource.RLIM_INFINITY and hard < 200000:
        pytest.skip("the hard file-size limit is below the test's")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(optiml.__file__)))
    r = subprocess.run([sys.executable, "-c", code, str(good), str(out)], capture_output=True, text=True, env=env)
    assert r.returncode == 3, r.stderr
    assert r.stdout.startswith(f"{out}: cannot write the GGUF file: ") and "ulimit -f" in r.stdout
    assert os.listdir(out.parent) == []


def test_the_output_is_synced_before_it_is_renamed(good, tmp_path, monkeypatch):
    """The complete file is fsync'ed under its temporary name: a crash after the rename finds its bytes on disk."""
    from optiml.convert import writer

    out = tmp_path / "m.gguf"
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append((os.fstat(fd).st_size, out.exists()))
        real(fd)

    monkeypatch.setattr(writer.os, "fsync", fsync)
    convert(good, out, type="q8_0")
    assert (os.path.getsize(out), False) in synced


# ---- corrupt sizes in config.json -------------------------------------------------------------------
SIZES = {  # config.json change -> the error, said before the tokenizer's tables or the tensor plan are built
    "layers-huge": ({"num_hidden_layers": 2000000},
                    "num_hidden_layers = 2000000 is more than the 4096 layers OptiML loads"),
    "layers-more": ({"num_hidden_layers": 4000}, "num_hidden_layers = 4000, but the checkpoint has tensors for 3 "
                                                 r"layers \(model.layers.0 to 2\)"),
    "vocab-huge": ({"vocab_size": 4000000000}, "vocab_size = 4000000000 is more than 1073741824 tokens"),
    "vocab-more": ({"vocab_size": 100000000}, r"model.embed_tokens.weight has shape \[300, 64\], config.json "
                                              r"implies \[100000000, 64\]"),
}


@pytest.mark.parametrize("kind", list(SIZES))
def test_corrupt_sizes_are_refused_before_any_work(good, tmp_path, monkeypatch, kind):
    import optiml.convert as C

    def never(*a, **k):
        raise AssertionError("built before the sizes were checked")

    monkeypatch.setattr(C.tokenizer, "load_vocab", never)  # ([None] * vocab_size)
    monkeypatch.setattr(C.hf_config, "tensor_plan", never)  # (every layer's tensors)
    change, message = SIZES[kind]
    cfg = json.loads((good / "config.json").read_text())
    cfg.update(change)
    (good / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=message):
        convert(good, tmp_path / "m.gguf", type="q8_0")
    assert not (tmp_path / "m.gguf").exists()


# ---- general.name -----------------------------------------------------------------------------------
def test_model_name(good, tmp_path, capsys):
    """The folder's name; a Hugging Face cache snapshot's repository name, not the commit's hash; --name."""
    assert fields(convert(good, tmp_path / "a.gguf", type="q8_0"))["general.name"] == "hf"
    snap = tmp_path / "hub" / "models--SomeOrg--Tiny-Model" / "snapshots" / ("0123456789abcdef" * 3)[:40]
    shutil.copytree(good, snap)
    assert fields(convert(snap, tmp_path / "b.gguf", type="q8_0"))["general.name"] == "Tiny-Model"
    assert fields(convert(str(snap) + "/", tmp_path / "b.gguf", type="q8_0"))["general.name"] == "Tiny-Model"
    assert fields(convert(snap, tmp_path / "c.gguf", type="q8_0", name="My Model"))["general.name"] == "My Model"
    assert cli.main(["convert", str(snap), "-o", str(tmp_path / "d.gguf"), "--type", "q8_0", "--name", "Tiny 2",
                     "-q"]) == 0
    assert fields(tmp_path / "d.gguf")["general.name"] == "Tiny 2"
