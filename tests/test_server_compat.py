"""optiml serve for clients and scripts written for llama-server: its flags (-c/--ctx-size, checked bounds),
its request fields (n_predict, cache_prompt, chat_template_kwargs, ...), its routes (/chat/completions,
/tokenize, /detokenize, ...) and its `timings` object; and OpenAI's newer fields that change nothing here."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
httpx = pytest.importorskip("httpx")

import optiml  # noqa: E402
from conftest import live_server  # noqa: E402
from optiml import cli  # noqa: E402
from optiml.cli import serve as serve_cli  # noqa: E402
from optiml.server.schemas import chat_request, completion_request  # noqa: E402

KEY = "sk-compat"
N_CTX = 256
MSGS = [{"role": "user", "content": "Name three colors."}]
NO_END = {"0": -100, "2": -100}  # SmolLM2's end-of-text and <|im_end|>: answers run to their limit


@pytest.fixture(scope="module")
def server(smollm2_path):
    from optiml.server import Server

    model = optiml.Model(smollm2_path, n_ctx=N_CTX, n_seq=2)
    srv = Server(model, n_parallel=2, api_key=KEY, model_id="smollm2", max_queue=4, chunk=32)
    with live_server(srv):
        yield srv


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- the command line ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["--port", "99999"], "--port must be in 0..65535"),
    (["--port", "-1"], "--port must be in 0..65535"),
    (["--parallel", "0"], "--parallel must be at least 1, got 0"),
    (["--queue", "-1"], "--queue must be at least 0"),
    (["--chunk", "0"], "--chunk must be at least 1"),
    (["--ctx", "0"], "--ctx must be at least 1"),
    (["-c", "512", "--ctx", "256"], "not both"),
    (["-c", "3", "--parallel", "4"], "less than one token each"),
    (["--ctx-size", "-8"], "-c/--ctx-size must be at least 0"),
    (["--port", "0", "--ray"], "not supported with --ray"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template-kwargs", "{\"messages\": 1}"], "may not set 'messages'"),
])
def test_bad_settings_are_one_line_before_the_model_loads(capsys, args, message):
    """Checked before the model is even looked for (the file does not exist): one line, exit status 2."""
    assert cli.main(["serve", "-m", "no-such-model.gguf", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("optiml serve: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args,n_ctx", [
    (["-c", "1024", "--parallel", "2"], 512),  # llama-server's: the total, shared by the slots
    (["--ctx-size", "1000", "-np", "3"], 333),
    (["-c", "1024"], 256),  # --parallel's default, 4
    (["-c", "0"], None),  # llama-server's 0: the model's own (the default)
    (["--ctx", "300"], 300),  # ours: per slot
])
def test_ctx_size_is_llama_servers_total(monkeypatch, smollm2_path, args, n_ctx):
    got = {}
    monkeypatch.setattr(serve_cli, "serve", lambda path, **kw: got.update(kw))
    assert cli.main(["serve", "-m", str(smollm2_path), *args]) == 0
    assert got["n_ctx"] == n_ctx


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("default: 8080", "default: 4", "default: 64", "default: 256", "-c N, --ctx-size N"):
        assert default in text, default


def test_port_0_announces_the_port_taken(smollm2_path):
    proc = subprocess.Popen([sys.executable, "-m", "optiml", "serve", "-m", str(smollm2_path), "-t", "1", "--ctx",
                             "64", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdout.readline()  # the model's line
        line = proc.stdout.readline()
        assert line.startswith("optiml serve: SmolLM2-135M-Instruct.Q4_1 on http://127.0.0.1:"), line
        url = line.split(" on ")[1].split("/v1;")[0]
        assert not url.endswith(":0")
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(60)


# The model's load held until the test writes a line ("fail": it raises instead), then serve() on the port given.
_HELD_LOAD = """
import sys
import optiml
import optiml.server as srv
real = srv.Model
def held(*a, **kw):
    if sys.stdin.readline().strip() == "fail":
        raise optiml.ArgumentError("the test's load failure")
    return real(*a, **kw)
srv.Model = held
srv.serve(sys.argv[1], port=int(sys.argv[2]), n_threads=1, n_ctx=64, n_parallel=1, log_level="warning")
"""


@pytest.mark.parametrize("outcome", ["loads", "fails", "interrupted"])
def test_the_port_answers_503_while_the_model_loads(smollm2_path, outcome):
    """As llama-server's: the port listens from the start and answers 503 "Loading model" (with Retry-After) to
    health checks and requests until the model is in; then 200 and the address line. A load that fails stops
    the server, and serve() raises its error; Ctrl-C during the load stops it at once, announcing nothing."""
    import signal
    import socket
    import time

    from conftest import child_env

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", _HELD_LOAD, str(smollm2_path), str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        for _ in range(600):
            try:
                r = httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                time.sleep(0.1)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["message"] == "Loading model"
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading_model"
        if outcome == "interrupted":
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)  # (the load is still held: it must not be waited for)
            assert " on http://" not in out, out  # (uvicorn raises the signal again once stopped: the CLI's 130)
            return
        proc.stdin.write("fail\n" if outcome == "fails" else "go\n")
        proc.stdin.flush()
        if outcome == "fails":
            out, err = proc.communicate(timeout=120)
            assert proc.returncode != 0 and "the test's load failure" in err, err[-2000:]
            assert " on http://" not in out
            return
        assert proc.stdout.readline().startswith("optiml serve: SmolLM2-135M-Instruct.Q4_1: ")  # the model's line
        assert proc.stdout.readline() == f"optiml serve: SmolLM2-135M-Instruct.Q4_1 on {url}/v1; chat page at {url}/\n"
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"  # ready when announced
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)


# ---- request fields -----------------------------------------------------------------------------------------
def test_n_predict_is_llama_servers_max_tokens():
    def limit(body, chat=True):
        if chat:
            return chat_request(dict(body, messages=MSGS), 100)[2]["max_tokens"]
        return completion_request(dict(body, prompt="x"), 100)[1]["max_tokens"]

    assert limit({"n_predict": 5}) == 5 and limit({"n_predict": 5}, chat=False) == 5
    assert limit({"n_predict": -1}) is None  # llama-server's "no limit"
    assert limit({"n_predict": 5, "max_tokens": 5}) == 5  # the same limit twice is no conflict
    assert limit({"n_predict": 5, "max_completion_tokens": 5}) == 5
    assert limit({"n_predict": -1, "max_tokens": 7}) == 7  # -1 is llama-server's default, sent beside max_tokens


def test_llama_server_and_newer_openai_fields_are_taken(server):
    base = {"messages": MSGS, "temperature": 0, "max_tokens": 3, "logit_bias": NO_END}
    want = post(server, "/v1/chat/completions", base).json()["choices"][0]["message"]["content"]
    for extra in ({"cache_prompt": True}, {"cache_prompt": False}, {"prompt_cache_key": "k", "safety_identifier": "u",
                  "verbosity": "low"}, {"modalities": ["text"]}, {"reasoning_format": "none"},
                  {"reasoning_format": "auto"}, {"chat_template_kwargs": {}}, {"grammar": None, "id_slot": None}):
        r = post(server, "/v1/chat/completions", dict(base, **extra))
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == want, extra
    body = {"messages": MSGS, "temperature": 0, "n_predict": 3, "logit_bias": NO_END}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = post(server, "/v1/completions", {"prompt": "Hi", "n_predict": 2, "logit_bias": NO_END, "cache_prompt": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize("extra,param,says", [
    ({"n_predict": 3, "max_tokens": 4}, "n_predict", "disagree"),
    ({"n_predict": 0}, "n_predict", "-1 (no limit) or >= 1"),
    ({"cache_prompt": "yes"}, "cache_prompt", "boolean"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"reasoning_format": "fancy"}, "reasoning_format", "must be one of"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set 'messages'"),
    ({"grammar": "root ::= \"a\""}, "grammar", "llama-server's 'grammar' is not supported"),
    ({"typical_p": 0.9}, "typical_p", "llama-server's 'typical_p' is not supported"),
    ({"json_schema": {}}, "json_schema", "llama-server's 'json_schema' is not supported"),
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
])
def test_fields_refused_say_why(server, extra, param, says):
    err = error(post(server, "/v1/chat/completions", dict({"messages": MSGS, "max_tokens": 2}, **extra)), 400)
    assert err["param"] == param and says in err["message"], err


def test_chat_template_kwargs_reach_the_template(server):
    """Qwen3's templates read enable_thinking: here a template that, like them, writes an empty think block
    when it is false; the prompt the server ran is the one rendered with the variable."""
    model = server.model
    model.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
                           "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    try:
        tpl = model.chat_template
        body = {"messages": MSGS, "max_tokens": 1}
        plain = post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
        r = post(server, "/v1/chat/completions", dict(body, chat_template_kwargs={"enable_thinking": False}))
        assert plain == len(server.chat_ids(tpl.render(MSGS)))
        assert r.json()["usage"]["prompt_tokens"] == len(server.chat_ids(tpl.render(MSGS, enable_thinking=False)))
        assert r.json()["usage"]["prompt_tokens"] > plain
        # --chat-template-kwargs: the server's variables for every request; a request's own win
        server.template_variables = {"enable_thinking": False}
        assert post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
        r = post(server, "/v1/chat/completions", dict(body, chat_template_kwargs={"enable_thinking": True}))
        assert r.json()["usage"]["prompt_tokens"] == plain
    finally:
        model.chat_template = None
        server.template_variables = {}


# ---- routes -------------------------------------------------------------------------------------------------
def test_llama_server_paths_without_v1(server):
    body = {"messages": MSGS, "temperature": 0, "max_tokens": 3}
    assert (post(server, "/chat/completions", body).json()["choices"]
            == post(server, "/v1/chat/completions", body).json()["choices"])
    body = {"prompt": "Hi", "temperature": 0, "max_tokens": 3}
    assert (post(server, "/completions", body).json()["choices"]
            == post(server, "/v1/completions", body).json()["choices"])
    r = httpx.get(server.url + "/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [m["id"] for m in r.json()["data"]] == ["smollm2"]
    assert error(post(server, "/chat/completions", body, key=None), 401)["code"] == "invalid_api_key"


def test_a_404_names_the_routes(server):
    err = error(post(server, "/completion", {"prompt": "Hi"}), 404)  # llama-server's own, not served here
    for route in ("POST /v1/chat/completions", "POST /completions", "POST /tokenize", "POST /detokenize",
                  "GET /v1/models/{name}", "GET /health"):
        assert route in err["message"], route


def test_tokenize_and_detokenize(server):
    tk = server.tokenizer
    text = "Hello <|im_start|> world 😀"
    r = post(server, "/tokenize", {"content": text})
    assert r.json() == {"tokens": tk.encode(text, add_special=False, parse_special=True)}  # llama-server's defaults
    assert post(server, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"] == tk.encode(
        text, add_special=False, parse_special=False)
    assert post(server, "/tokenize", {"content": "Hi", "add_special": True}).json()["tokens"] == tk.encode("Hi")
    ids = r.json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text}  # special tokens as text
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes span tokens: not UTF-8 alone
    assert error(post(server, "/tokenize", {"text": "Hi"}), 400)["param"] == "text"
    assert error(post(server, "/tokenize", {"content": 5}), 400)["param"] == "content"
    assert error(post(server, "/detokenize", {"tokens": [1, -1]}), 400)["param"] == "tokens"
    assert error(post(server, "/detokenize", {"tokens": [1]}, key=None), 401)["code"] == "invalid_api_key"


# ---- timings ------------------------------------------------------------------------------------------------
def check_timings(t, prompt_tokens, cached, completion_tokens):
    assert t["prompt_n"] == prompt_tokens - cached and t["cache_n"] == cached
    assert t["predicted_n"] == completion_tokens
    assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] * 1000 / t["prompt_ms"])
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / t["predicted_n"])
    if t["predicted_ms"] > 0:
        assert t["predicted_per_second"] == pytest.approx(t["predicted_n"] * 1000 / t["predicted_ms"])


def test_timings_as_llama_server_gives_them(server):
    body = {"messages": [{"role": "user", "content": "Timings, please."}], "temperature": 0, "max_tokens": 4,
            "logit_bias": NO_END}
    for _ in range(2):  # the second time, the prefix cache holds all but the last prompt token
        r = post(server, "/v1/chat/completions", body).json()
        u = r["usage"]
        check_timings(r["timings"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], 4)
    assert r["timings"]["prompt_n"] == 1
    r = post(server, "/v1/completions", {"prompt": "One, two,", "max_tokens": 2, "n": 2, "logit_bias": NO_END}).json()
    assert r["timings"]["predicted_n"] == 4  # both choices' tokens


@pytest.mark.parametrize("path,usage", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                        ("/v1/completions", False)])
def test_a_stream_ends_with_its_timings(server, path, usage):
    """In the last chunk before [DONE] (the usage chunk when there is one), as llama-server puts them."""
    body = {"max_tokens": 3, "stream": True, "logit_bias": NO_END}
    body.update({"messages": MSGS} if "chat" in path else {"prompt": "Hi"})
    if usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [("timings" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last["timings"]["predicted_n"] == 3
    if usage:
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    else:
        assert last["choices"][0]["finish_reason"] == "length"
