"""Output people can script: --json on info, bench and perplexity (one object on stdout, strict JSON: no NaN
or Infinity), --quiet (nothing on stderr), and exit statuses (2 bad input, 1 a failure while running)."""

import csv
import io
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

import optiml
from optiml import cli
from optiml.evaluate import perplexity as px
from optiml.util import jsonout

from conftest import ROOT, child_env, tiny_model

TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
        "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors. ") * 4


def test_info_json_matches_gguf_py(smollm2_path, capfd):
    assert cli.main(["info", "--json", "--tensors", str(smollm2_path)]) == 0
    out, err = capfd.readouterr()
    info = json.loads(out)  # one object: json.loads refuses anything more on stdout
    ref = gguf.GGUFReader(str(smollm2_path))
    assert info["n_tensors"] == len(ref.tensors) == len(info["tensors"])
    assert [t["name"] for t in info["tensors"]] == [t.name for t in ref.tensors]
    assert info["metadata"]["llama.block_count"] == int(ref.fields["llama.block_count"].contents())
    assert info["metadata"]["general.architecture"] == "llama"
    assert info["metadata"]["tokenizer.ggml.tokens"]["length"] == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert info["hparams"]["n_layer"] == 30 and info["placement"] is None
    assert info["file_size"] == smollm2_path.stat().st_size
    assert cli.main(["info", "--json", "--plan", str(smollm2_path)]) == 2


def test_bench_json(smollm2_path, capfd):
    """-o json (--json): llama-bench's list of tests, each with its runs' speeds, their mean and deviation."""
    args = ["-q", "bench", "--json", "-m", str(smollm2_path), "-p", "8,16", "-n", "4", "-pg", "8,2", "-r", "2", "-t", "2"]
    assert cli.main(args) == 0
    out, err = capfd.readouterr()
    rows = json.loads(out)
    assert err == ""
    assert [(r["test"], r["n_prompt"], r["n_gen"]) for r in rows] == [("pp8", 8, 0), ("pp16", 16, 0), ("tg4", 0, 4),
                                                                      ("pp8+tg2", 8, 2)]
    for r in rows:
        ts = r["samples_ts"]
        assert len(ts) == 2 and min(ts) > 0 and r["avg_ts"] == pytest.approx(sum(ts) / 2)
        assert r["stddev_ts"] == pytest.approx(abs(ts[0] - ts[1]) / 2 ** 0.5)
        assert r["model_type"] == "llama 135M Q4_1" and r["backends"] == "CPU" and r["n_threads"] == 2
    f = gguf.GGUFReader(str(smollm2_path))  # (gguf-py's count of the file's parameters and bytes)
    assert rows[0]["model_n_params"] == sum(int(t.n_elements) for t in f.tensors)
    assert rows[0]["model_size"] == sum(int(t.n_bytes) for t in f.tensors)

    assert cli.main(["-q", "bench", "-o", "csv", "-m", str(smollm2_path), "-p", "0", "-n", "2", "-r", "2"]) == 0
    table = list(csv.DictReader(io.StringIO(capfd.readouterr().out)))
    assert [r["test"] for r in table] == ["tg2"] and len(table[0]["samples_ts"].split(",")) == 2


def test_perplexity_json_and_quiet(smollm2_path, tmp_path, capfd):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    args = ["perplexity", "-m", str(smollm2_path), "-f", str(text), "--ctx", "64", "-t", "2"]
    assert cli.main([*args, "--json", "-q"]) == 0
    out, err = capfd.readouterr()
    r = json.loads(out)
    assert err == ""  # --quiet: no progress, no log lines
    with optiml.Model(smollm2_path, n_ctx=64, n_threads=2) as m:
        ppl, ppl_err, count = px.perplexity(m, TEXT, 64)
    assert r["ppl"] == pytest.approx(ppl, rel=1e-9) and r["ppl_err"] == pytest.approx(ppl_err, rel=1e-9)
    assert r["n_tokens"] == count and r["n_ctx"] == 64
    # Without --quiet the progress goes to stderr, never into the result on stdout.
    assert cli.main(args) == 0
    out, err = capfd.readouterr()
    assert out == f"Final estimate: PPL = {ppl:.4f} +/- {ppl_err:.5f}\n" and "tokens scored" in err and "[1]" in err
    # The KL divergence comparison as JSON: the summary of compare().
    base = str(tmp_path / "base.kld")
    assert cli.main([*args, "-q", "--kl-divergence-base", base]) == 0
    capfd.readouterr()
    assert cli.main(["perplexity", "-m", str(smollm2_path), "-t", "2", "--kl-divergence-base", base,
                     "--kl-divergence", "--json"]) == 0
    r = json.loads(capfd.readouterr().out)
    assert r["kld_mean"] == pytest.approx(0, abs=1e-6) and r["same_top"] == 1.0 and r["n_ctx"] == 64
    # -b/--batch-size (llama.cpp's -ub too): the window read in steps of 16 tokens scores as one step of 64
    assert cli.main(["perplexity", "-m", str(smollm2_path), "-t", "2", "--kl-divergence-base", base,
                     "--kl-divergence", "--json", "-b", "16"]) == 0
    r = json.loads(capfd.readouterr().out)
    assert r["kld_mean"] < 1e-6 and r["same_top"] == 1.0


def test_exit_statuses(smollm2_path, tmp_path, capfd):
    missing = str(tmp_path / "missing.gguf")
    # Bad input: 2.
    assert cli.main(["run", "-m", missing, "-p", "x"]) == 2
    assert "no such model file" in capfd.readouterr().err
    assert cli.main(["info", missing]) == 2
    assert cli.main(["bench", "--json", "-m", missing]) == 2
    assert capfd.readouterr().out == ""  # nothing on stdout when it fails, not even with --json
    assert cli.main(["perplexity", "-m", str(smollm2_path)]) == 2  # no -f
    assert cli.main(["perplexity", "-m", str(smollm2_path), "-f", str(tmp_path / "none.txt")]) == 2
    assert cli.main(["pull", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capfd.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--no-such-option"])
    assert e.value.code == 2
    # A failure while running: 1 (a file that is not a GGUF).
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    assert cli.main(["run", "-m", str(bad), "-p", "x"]) == 1
    assert "error:" in capfd.readouterr().err


def test_bad_flags_are_bad_input(smollm2_path, tmp_path, capfd):
    """Values a command cannot honour are refused before any work (exit 2, the flag named), never run into a
    traceback or a wrong result (bench once printed a negative speed for -n -1)."""
    m = str(smollm2_path)
    for args, said in ((["bench", "-m", m, "-n", "-1"], "-n/--n-gen"), (["bench", "-m", m, "-p", "-3"], "-p/--n-prompt"),
                       (["bench", "-m", m, "-p", "0", "-n", "0"], "no test to run"), (["bench", "-m", m, "-pg", "8"], "-pg"),
                       (["bench", "-m", m, "-r", "0"], "-r/--repetitions"), (["bench", "-m", m, "-b", "4"], "--launches"),
                       (["bench", "-m", m, "-p", "100", "--ctx", "50"], "--ctx 50"),
                       (["run", "-m", m, "-p", "x", "-n", str(2**70)], "at most"),
                       (["run", "-m", m, "-p", "x", "-t", "100000"], "n_threads"),
                       (["run", "-m", m, "-p", "x", "-b", "0"], "-b/--batch-size"),
                       (["info", str(tmp_path)], "is a folder"),
                       (["perplexity", "-m", m, "-f", __file__, "--ctx", "64", "--chunks", "0"], "--chunks"),
                       (["convert", str(tmp_path), "-o", str(tmp_path / "x.gguf")], "no config.json"),
                       (["hw", "--device", "cuda:7"], "no such CUDA device"),  # (before a minute of CPU timings)
                       (["chat", m, "-m", str(tmp_path / "other.gguf")], "two models given"),
                       (["chat", m, "-n", "-2"], "-n/--n-predict"),  # (before the model loads; -1 is no limit)
                       (["bench", "-m", m, "--launches", "2", "--timeline", "4"], "two reports")):
        assert cli.main(["-q", *args]) == 2, args
        err = capfd.readouterr().err
        assert said in err and "Traceback" not in err, (args, err)


def test_llama_cpp_flags(smollm2_path, capfd):
    """llama.cpp's spellings mean what they mean there (-c/--ctx-size, --predict, -s, -n -1, --seed -1), and a
    flag of llama.cpp's that is ours by its first letters is refused, not taken for ours (--predict used to
    be --predictors, by argparse's abbreviations)."""
    m = str(smollm2_path)
    base = ["-q", "run", "-m", m, "-p", "1, 2, 3,", "--temp", "0"]
    assert cli.main(base + ["-c", "32", "-n", "-1", "-s", "-1"]) == 0
    want = capfd.readouterr().out
    assert cli.main(base + ["--ctx-size", "32", "--predict", "100"]) == 0
    assert capfd.readouterr().out == want  # (both end at the full context of 32)
    assert cli.main(base + ["--ctx", "32", "-n", "100", "--seed", "7"]) == 0
    assert capfd.readouterr().out == want
    with pytest.raises(SystemExit) as e:
        cli.main(base + ["--predictor", "x"])
    err = capfd.readouterr().err  # (the command's usage and name, not optiml's)
    assert e.value.code == 2 and "optiml run: error: unrecognized arguments: --predictor" in err and "usage: optiml run" in err
    # llama.cpp's -mli and -no-cnv are not ours: refused, not read as -m "li" or -n "o-cnv"
    for word in ("-mli", "-no-cnv"):
        with pytest.raises(SystemExit) as e:
            cli.main(["-q", "run", word, "-m", m, "-p", "Hi"])
        assert e.value.code == 2 and f"unrecognized argument: {word}" in capfd.readouterr().err


def test_gpu_flags_without_a_gpu_say_so(smollm2_path, capfd):
    """llama.cpp's -ngl on a machine whose model runs on the CPU: it runs, and a log line says why -ngl did
    nothing; -ngl past the model's layers means all of them (llama.cpp's -ngl 99)."""
    assert cli.main(["run", "-m", str(smollm2_path), "-p", "Hi", "-n", "1", "--temp", "0", "--device", "cpu",
                     "-ngl", "99"]) == 0
    assert "-ngl ignored, the model runs on the CPU" in capfd.readouterr().err
    assert cli.main(["info", "--plan", "--device", "cpu", "--cpu-moe", str(smollm2_path)]) == 0  # (no weights read)
    out = capfd.readouterr()
    assert "--cpu-moe ignored, the model runs on the CPU" in out.err and out.out.startswith("device: none")
    with optiml.Model(smollm2_path, n_ctx=64, device="cpu:1", n_gpu_layers=99) as m:
        assert all(layer["attention"] != "cpu" for layer in m.plan.layers)


def test_text_that_is_not_utf8_from_the_command_line(smollm2_path, tmp_path):
    """Bytes that are not UTF-8 in argv or on stdin (Python holds them as lone surrogates) are tokenized as
    those bytes are, as llama.cpp reads them, instead of ending the command in a UnicodeEncodeError."""
    env = dict(os.environ)
    prompt = os.fsdecode(b"\xff\xfeHello")
    r = subprocess.run([sys.executable, "-m", "optiml", "-q", "run", "-m", str(smollm2_path), "-p", prompt, "-n", "2",
                        "--temp", "0"], capture_output=True, env=env)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    r = subprocess.run([sys.executable, "-m", "optiml", "-q", "run", "-m", str(smollm2_path), "-n", "2", "--temp", "0"],
                       input=b"\xc3(\x80 Once upon a time", capture_output=True, env=env)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    tk = optiml.tokenizer.load(smollm2_path)
    assert tk.encode(os.fsdecode(b"ab\xffcd")) == tk.encode(b"ab\xffcd")  # as the original bytes
    assert tk.encode("a\ud800b") == tk.encode("a\ufffdb")  # a surrogate from nowhere: U+FFFD
    with pytest.raises(optiml.ArgumentError, match="str or bytes"):
        tk.encode(None)
    with pytest.raises(FileNotFoundError):
        optiml.tokenizer.load(tmp_path / "none.gguf")


def test_broken_pipe_is_not_an_error(smollm2_path):
    env = dict(os.environ)
    # (far more than a pipe's buffer: one line per token)
    p = subprocess.Popen([sys.executable, "-m", "optiml", "-q", "tokenize", "-m", str(smollm2_path), "-p", TEXT * 40],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.readline()
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "error" not in err and "Traceback" not in err and "Exception" not in err, err
    assert p.returncode == 141


def test_exit_status_of_the_command(tmp_path):
    """The same through the process: `python -m optiml`, as a shell script sees it."""
    env = dict(os.environ)  # optiml as the tests import it (installed, or PYTHONPATH=python)
    r = subprocess.run([sys.executable, "-m", "optiml", "-q", "info", str(tmp_path / "missing.gguf")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stdout == "" and "no such model file" in r.stderr
    r = subprocess.run([sys.executable, "-m", "optiml", "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == f"optiml {optiml.__version__}"


def strict_json(text: str):
    """json.loads refusing NaN, Infinity and -Infinity (which Python's parser takes by default, and others do not)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_jsonout_replaces_non_finite_values():
    obj = {"a": float("nan"), "b": [np.float32("inf"), 1.5, np.array([np.nan, 2.0])], "c": (1, -float("inf")),
           "d": np.int64(3), "e": b"x\xff", "f": True, "g": None}
    text = jsonout.dumps(obj)
    assert strict_json(text) == {"a": None, "b": [None, 1.5, [None, 2.0]], "c": [1, None], "d": 3, "e": "x\ufffd",
                                 "f": True, "g": None}
    with pytest.raises(TypeError):
        jsonout.dumps({"x": object()})


def test_info_json_is_strict_with_nan_placement(tmp_path, capfd):
    """A placement whose coverage (and estimate, solver gap, hardware figure) is NaN or infinite: info --json
    writes null there, and the text form still prints."""
    P = "optiml.placement."
    VT = gguf.GGUFValueType
    path = tiny_model(tmp_path / "nan-placement.gguf", **{
        P + "version": (2, VT.UINT32), P + "gpu_neurons": (np.array([64, 32], np.int32), VT.ARRAY),
        P + "coverage": (np.array([np.nan, 0.5], np.float32), VT.ARRAY),
        P + "est_token_ms": (float("nan"), VT.FLOAT32),
        P + "solver": ('{"method": "highs", "status": "optimal", "gap": Infinity, "solve_s": 0.1}', VT.STRING),
        P + "hardware": ('{"gpu_bandwidth": NaN}', VT.STRING)})
    assert cli.main(["info", "--json", str(path)]) == 0
    info = strict_json(capfd.readouterr().out)
    pl = info["placement"]
    assert pl["coverage"] == [None, 0.5] and pl["est_token_ms"] is None and pl["gpu_neurons"] == [64, 32]
    assert pl["solver"]["gap"] is None and pl["hardware"]["gpu_bandwidth"] is None
    assert info["companions"]["placement"]["in_file"] and not info["companions"]["placement"]["used"]
    assert cli.main(["info", str(path)]) == 0
    out = capfd.readouterr().out
    assert "placement: in the file, not used: the default device runs every layer on the CPU" in out


def test_bench_harness_json_is_strict(tmp_path):
    """tools/bench's --json files: a row with NaN and infinite figures is written with null there."""
    out = tmp_path / "r.json"
    code = ("import harness; r = harness.Results('t'); r.add(model='m', ratio=float('nan'), tps=float('inf'), n=2); "
            f"r.write({str(out)!r})")
    env = child_env()
    env["PYTHONPATH"] = str(ROOT / "tools" / "bench") + os.pathsep + env["PYTHONPATH"]
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=ROOT / "tools" / "bench", env=env)
    doc = strict_json(out.read_text())
    assert doc["rows"] == [{"model": "m", "ratio": None, "tps": None, "n": 2}]


def test_server_json_is_strict():
    """The server's JSON answers (completions with logprobs of -inf, statistics not measured yet): null."""
    pytest.importorskip("starlette")
    from optiml.server.app import JSONResponse, _dumps

    assert JSONResponse({"logprob": float("-inf"), "x": [float("nan"), 1.0]}).body == b'{"logprob":null,"x":[null,1.0]}'
    assert strict_json(_dumps({"top_logprobs": {"a": float("-inf")}})) == {"top_logprobs": {"a": None}}


def test_a_partial_serve_install_is_named_before_any_work(monkeypatch):
    """uvicorn alone is not the serve extra: every package the server imports is checked, and the message names
    the missing ones and the extra (not an ImportError from inside the server, after the model loaded)."""
    import importlib.util

    from optiml import server

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "anyio" else real(name, *a))
    with pytest.raises(SystemExit, match=r"anyio missing.*optiml\[serve\]"):
        server.check_server_packages()


def test_info_plot_checks_its_inputs_before_the_report(smollm2_path, tmp_path, capfd):
    assert cli.main(["info", str(smollm2_path), "--plot", str(tmp_path / "p.png"), "--stats",
                     str(tmp_path / "missing.npz")]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "missing.npz" in err
