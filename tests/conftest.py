import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# "A Scandal in Bohemia" (Project Gutenberg EBook #1661, public domain): the reference text of the fidelity,
# tokenizer and profiling tests, kept in the repository so that a clone alone runs them (tests/data/README.md).
EVAL_TEXT = ROOT / "tests" / "data" / "scandal-in-bohemia.txt"


# sparsity="auto" times the sparse FFN against the dense one before keeping it (optiml.engine.speed_probe); the
# tests assert what a file's sparsity computes, which must not hang on how busy the machine was at load time.
# tests/test_speed_probe.py turns it back on with a fixed clock.
os.environ.setdefault("OPTIML_SPARSITY_PROBE", "off")


def model_cache() -> Path:
    """The package's own model cache ($OPTIML_MODEL_CACHE, else $OPTIML_HOME/models, else ~/.cache/optiml/models),
    where tools/fetch_models.py puts the reference models."""
    from optiml.hub.registry import cache_dir

    return cache_dir()


def model_path(name: str) -> Path:
    entry = json.loads((ROOT / "models" / "manifest.json").read_text())["models"][name]
    return model_cache() / entry["file"]


def _missing(what: str, how: str):
    """A missing reference input fails under CI (it must be there) and skips elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing: {how}")
    pytest.skip(f"{what} missing; {how}")


def llama_cpp_module():
    """llama-cpp-python, the CPU peer: required under CI (the test extra installs it), a skip elsewhere."""
    try:
        import llama_cpp
    except ImportError:
        _missing("llama_cpp (llama-cpp-python)", "pip install '.[test]'")
    return llama_cpp


def shared_eval_text() -> str:
    """tests/data/scandal-in-bohemia.txt: the text shared/eval/REFERENCE.md's peer figures were measured on."""
    return EVAL_TEXT.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (fetched by tools/fetch_models.py; .ci/run does it)."""
    p = model_path("smollm2-135m-instruct-q4_1")
    if not p.is_file():
        _missing(str(p), "run: python tools/fetch_models.py smollm2-135m-instruct-q4_1 (.ci/run does)")
    return p


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma3-270M Q4_K_M GGUF (fetched by tools/fetch_models.py; .ci/run does it)."""
    p = model_path("gemma3-270m-q4_k_m")
    if not p.is_file():
        _missing(str(p), "run: python tools/fetch_models.py gemma3-270m-q4_k_m (.ci/run does)")
    return p


@contextlib.contextmanager
def live_server(srv):
    """Serves optiml.server.Server `srv` with uvicorn on a free loopback port, in a thread; srv.url is its
    address while the block runs."""
    import uvicorn

    from optiml.server import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(srv), log_level="warning"))
    t = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    assert uv.started, "the server did not start"
    srv.url = f"http://127.0.0.1:{port}"
    try:
        yield srv
    finally:
        uv.should_exit = True
        t.join(timeout=30)
        sock.close()


# Children import the same optiml this process did (the installed package under CI, the source tree in a dev loop).
def stream_long_and_short(url: str):
    """Two streamed completions through `url` in threads, a long one (3000 tokens) and a short one (16): returns
    (got, readers) once both have their first piece; got[name] is each stream's "data: " payloads when it ends
    (for tests of what a server's shutdown does to running answers). The short one must end within the drain
    time (5 s) on a loaded machine: in a fresh-clone run of .ci/run at 9935c15, 40 tokens behind Ray Serve's
    relay took longer, with the sanitizer and emulator jobs running beside the tests."""
    import httpx

    got = {}

    def read(name, max_tokens, started):
        body = {"prompt": "1, 2, 3,", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
            got[name] = lines

    started = [threading.Event(), threading.Event()]
    readers = [threading.Thread(target=read, args=("long", 3000, started[0])),
               threading.Thread(target=read, args=("short", 16, started[1]))]
    for t in readers:
        t.start()
    for e in started:
        assert e.wait(120)
    return got, readers


def child_env() -> dict:
    import optiml

    here = os.path.dirname(os.path.dirname(os.path.abspath(optiml.__file__)))
    return dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))


def tiny_model(path, **kv) -> Path:
    """A 2-layer synthetic llama (tools/make_synthetic_model.py: the reference SmolLM2's tokenizer, random
    weights, ~8 MB) at `path`; kv: GGUF metadata to set on it ({key: (value, gguf.GGUFValueType or None)})."""
    import subprocess
    import sys

    donor = model_path("smollm2-135m-instruct-q4_1")
    if not donor.is_file():
        _missing(str(donor), "run: python tools/fetch_models.py smollm2-135m-instruct-q4_1 (.ci/run does)")
    path = Path(path)
    base = path.with_name(path.stem + ".base.gguf") if kv else path
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_model.py"), "-o", str(base), "--quiet",
                    "--n-embd", "64", "--n-layer", "2", "--n-ff", "128", "--n-head", "2", "--n-head-kv", "2",
                    "--type", "q8_0", "--tokenizer-from", str(donor)], check=True, capture_output=True, env=child_env())
    if kv:
        from optiml.formats.gguf_edit import rewrite_gguf

        rewrite_gguf(str(base), str(path), set_kv=kv, progress=False)
        base.unlink()
    return path


def fixed_predictor(model_path, out, active: float, recorded_share: float, seed: int = 0) -> str:
    """A predictor file for model_path marking the same random `active` share of each layer's neurons at every
    token (zero low-rank part, random biases against the threshold); the file says `recorded_share` were
    active on held-out tokens (what Model's predictors="auto" and down_copy="auto" read)."""
    import statistics

    import numpy as np

    import optiml
    from optiml.formats import predictors as PF
    from optiml.formats.stats import model_fingerprint
    from optiml.offline import predictors as P

    hp = optiml.Model(model_path, n_ctx=64, predictors=None).hparams
    L, E, F, r = hp["n_layer"], hp["n_embd"], hp["n_ff"], 32
    t = statistics.NormalDist().inv_cdf(1 - active)
    res = P.PredictorTraining(np.full(L, r, np.int32), np.full(L, t, np.float32), np.ones(L, np.float32),
                              np.full(L, recorded_share, np.float32), np.zeros(L, np.float32),
                              np.zeros(L, np.float32), 0.99, 0, "q8_0")
    rng = np.random.default_rng(seed)
    layers = [(np.zeros((r, E), np.float32), np.zeros((F, r), np.float32), rng.standard_normal(F, dtype=np.float32))
              for _ in range(L)]
    PF.write(str(out), layers, res, str(model_path), model_fingerprint(str(model_path)), hp)
    return str(out)


def check_prefix_copy_and_truncate(m, p: list) -> None:
    """On a Model of n_seq >= 3 and a prompt p: a prefix copied to another sequence, and a sequence truncated and
    continued, give the bits of the sequence that was never copied or cut (the same positions hold the same
    blocks), and the logits of the prompt read in one step (another batch shape: the same kernels per token)."""
    import numpy as np

    from optiml.engine.batch import Batch

    ref = m.decode(Batch().add_sequence(p, seq=0, logits="all"))
    m.kv_copy(0, 1, len(p) - 2)
    m.kv_copy(0, 2)
    m.kv_truncate(2, len(p) - 2)
    b = Batch().add_sequence(p[-2:], seq=1, pos=len(p) - 2, logits="all")
    b.add_sequence(p[-2:], seq=2, pos=len(p) - 2, logits="all")
    b.add_sequence(p[-2:], seq=0, pos=len(p) - 2, logits="all")  # rewrites its own last two positions
    m.kv_truncate(0, len(p) - 2)
    out = m.decode(b)
    assert np.array_equal(out[0:2], out[4:6]) and np.array_equal(out[2:4], out[4:6])
    np.testing.assert_allclose(out[4:6], ref[-2:], rtol=0, atol=1e-3)


@pytest.fixture(scope="module")
def llm(request):
    """llama-cpp-python on the test module's reference model (REFERENCE_MODEL names its path fixture)."""
    import fidelity

    llama_cpp_module()
    peer = fidelity.load_llama_cpp(request.getfixturevalue(request.module.REFERENCE_MODEL), 512)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def llama_greedy(llm, request):
    """llama.cpp's 32 greedy tokens after the module's PROMPT_IDS, computed here, and its top-2 gaps."""
    import fidelity

    return fidelity.llama_cpp_greedy(llm, request.module.PROMPT_IDS, 32)
