"""Model(use_mmap=...): weights mapped from the file, or read into private (huge-page) memory."""

import numpy as np
import pytest

import optiml
from optiml import model as model_mod


def test_in_memory_runs_the_same_bits_as_mapped(smollm2_path):
    ids = list(range(100, 140))
    mapped = optiml.Model(smollm2_path, n_ctx=128, n_threads=2, use_mmap=True)
    copied = optiml.Model(smollm2_path, n_ctx=128, n_threads=2, use_mmap=False)
    assert not mapped.in_memory and copied.in_memory
    a = mapped.eval(ids, all_logits=True)
    b = copied.eval(ids, all_logits=True)
    assert np.array_equal(a, b)  # the same bytes, the same kernels
    assert np.array_equal(mapped.eval([7]), copied.eval([7]))


def test_in_memory_sparse_path(gemma3_path):
    # the sparse FFN's copies are made from the in-memory weights as from mapped ones
    ids = list(range(200, 230))
    out = []
    for use_mmap in (True, False):
        m = optiml.Model(gemma3_path, n_ctx=64, n_threads=2, use_mmap=use_mmap, sparsity="threshold",
                         thresholds=0.05)
        out.append(m.eval(ids, all_logits=True))
    assert np.array_equal(out[0], out[1])


@pytest.mark.parametrize("bad", ["yes", 0, None, "mmap"])
def test_use_mmap_rejects(smollm2_path, bad):
    with pytest.raises(optiml.ArgumentError, match="use_mmap must be True, False or 'auto'"):
        optiml.Model(smollm2_path, n_ctx=64, use_mmap=bad)


def test_auto_maps_when_the_gpu_runs_layers(smollm2_path):
    # weights a device holds need no private host copy
    p = str(smollm2_path)
    assert not model_mod._read_into_memory(p, "auto", "cuda", None, None)
    assert not model_mod._read_into_memory(p, "auto", "cpu", 4, None)
    assert not model_mod._read_into_memory(p, "auto", "cpu", None, [16] * 30)
    assert model_mod._read_into_memory(p, False, "cuda", None, None)
    assert not model_mod._read_into_memory(p, True, "cpu", None, None)


def test_auto_on_the_cpu_follows_the_os(smollm2_path, monkeypatch):
    p = str(smollm2_path)
    monkeypatch.setattr(model_mod, "_huge_pages_allowed", lambda: True)
    monkeypatch.setattr(model_mod, "_memory_available", lambda: 1 << 40)
    assert model_mod._read_into_memory(p, "auto", "cpu", None, None)
    monkeypatch.setattr(model_mod, "_memory_available", lambda: smollm2_path.stat().st_size)  # under twice the file
    assert not model_mod._read_into_memory(p, "auto", "cpu", None, None)
    monkeypatch.setattr(model_mod, "_memory_available", lambda: 1 << 40)
    monkeypatch.setattr(model_mod, "_huge_pages_allowed", lambda: False)
    assert not model_mod._read_into_memory(p, "auto", "cpu", None, None)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 100])
def test_bad_files_fail_alike(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    msgs = []
    for use_mmap in (True, False):
        with pytest.raises(optiml.OptimlError) as e:
            optiml.Model(bad, use_mmap=use_mmap)
        msgs.append((type(e.value), str(e.value)))
    assert msgs[0] == msgs[1]
