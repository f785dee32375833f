"""Chat template failures end as optiml.ChatTemplateError (an OptimlError) naming the model's template and the
problem, on every path (issue #47): ChatTemplate and Model.chat, the REPL and `optiml chat` (a message, never a
traceback), and the server (an OpenAI-style error body: 400 when the template refuses the messages, 500 when
the model's template is broken or hostile)."""

import io
import subprocess
import sys

import gguf
import pytest

import optiml
from optiml.cli.chat import repl
from optiml.engine.chat_template import ChatTemplate, ChatTemplateError, TemplateLimitError
from optiml.formats.gguf_edit import rewrite_gguf

from conftest import child_env, tiny_model

MSGS = [{"role": "user", "content": "Hi"}]
BLOCKED = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
SYNTAX = "{% for m in messages %}{{ m['content'] }"
REFUSES = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
           "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RENDER = "{{ messages[0]['content'] / 2 }}"
CHILD_ENV = child_env()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(template, name): a small synthetic model whose tokenizer.chat_template is `template`."""
    d = tmp_path_factory.mktemp("tpl")
    base = tiny_model(d / "tiny.gguf")

    def make(template: str, name: str) -> str:
        out = d / name
        rewrite_gguf(str(base), str(out), set_kv={"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)},
                     progress=False)
        return str(out)

    return make


@pytest.mark.parametrize("source, problem, words", [
    (BLOCKED, "blocked", "was blocked by the sandbox (access to attribute '__class__'"),
    (SYNTAX, "syntax", "does not compile (line 1:"),
    (REFUSES, "refused", "refuses these messages: System role not supported"),
    (RENDER, "render", "failed while rendering (TypeError:"),
    ("{{ 'x' * 1000000000 }}", "limit", ": its repeated value exceeds"),
])
def test_template_failures_name_the_template_and_the_problem(source, problem, words):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source, name="model.gguf").render([{"role": "system", "content": "Be brief."}] + MSGS)
    assert isinstance(e.value, optiml.OptimlError) and e.value.problem == problem
    assert str(e.value).startswith("the chat template of model.gguf") and words in str(e.value)
    assert e.value.template == "the chat template of model.gguf"
    assert isinstance(e.value, TemplateLimitError) == (problem == "limit")
    if problem != "refused":  # what to do about it
        assert "use another model file, or give a template of your own" in str(e.value) or problem == "limit"


def test_fallback_template_is_named_as_such():
    class Vocab:
        bos_id = eos_id = -1

        def token_id(self, t):
            return 1 if t in ("<|im_start|>", "<|im_end|>") else -1

    tpl = ChatTemplate.for_tokenizer(None, Vocab(), "plain.gguf")
    assert tpl.fallback and tpl.what == "the ChatML fallback chat template (plain.gguf has none)"


def test_model_chat_raises_chat_template_error(tiny, smollm2_path):
    for source, problem in ((BLOCKED, "blocked"), (RENDER, "render"), (SYNTAX, "syntax")):
        path = tiny(source, f"{problem}.gguf")
        with optiml.Model(path, n_ctx=64, n_threads=1) as m:
            for call in (lambda: m.chat(MSGS, max_tokens=2), lambda: m.chat(MSGS, stream=True, max_tokens=2),
                         lambda: m.chat_prompt(MSGS)):
                with pytest.raises(ChatTemplateError, match=rf"^the chat template of {problem}\.gguf ") as e:
                    call()
                assert e.value.problem == problem
            # the model stays usable: another template, or plain generation
            m.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            assert isinstance(m.chat(MSGS, max_tokens=2, temperature=0), str)
    with optiml.Model(smollm2_path, n_ctx=64, n_threads=1) as m:
        with pytest.raises(ChatTemplateError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
            m.chat_template = SYNTAX
        m.chat_template = BLOCKED
        with pytest.raises(ChatTemplateError, match="blocked by the sandbox"):
            m.chat(MSGS)
        m.chat_template = None  # the file's own again
        assert m.chat(MSGS, max_tokens=4, temperature=0)
        with pytest.raises(optiml.ArgumentError):
            m.chat_template = 42


def test_repl_reports_a_failing_turn_and_goes_on(smollm2_path):
    lines = iter(["/system Be brief.", "Hi!", "/system", "/reset", "Hi!", "/exit"])
    out = io.StringIO()
    with optiml.Model(smollm2_path, n_ctx=256, n_threads=2) as m:
        m.chat_template = REFUSES
        assert repl(m, max_tokens=4, sampling={"temperature": 0}, out=out, read=lambda p: next(lines)) == 0
    text = out.getvalue()
    assert "[error: the chat template of SmolLM2-135M-Instruct.Q4_1.gguf (set by Model.chat_template) refuses " \
           "these messages: System role not supported;" in text


def test_optiml_chat_never_shows_a_traceback(tiny):
    """A template that does not compile: `optiml chat` exits with status 1 and the message. One the sandbox
    blocks: each turn says so and the REPL goes on until the input ends (status 0)."""
    bad = tiny(SYNTAX, "syntax-cli.gguf")
    r = subprocess.run([sys.executable, "-m", "optiml", "chat", bad, "-t", "1", "--ctx", "64"], input="Hi\n",
                       capture_output=True, text=True, env=CHILD_ENV, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert r.stderr.startswith("optiml chat: error: the chat template of syntax-cli.gguf does not compile")
    hostile = tiny(BLOCKED, "blocked-cli.gguf")
    r = subprocess.run([sys.executable, "-m", "optiml", "chat", hostile, "-t", "1", "--ctx", "64"],
                       input="Hi\nHello?\n", capture_output=True, text=True, env=CHILD_ENV, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stdout.count("[error: the chat template of blocked-cli.gguf was blocked by the sandbox") == 2


def test_server_answers_template_errors_as_json(smollm2_path):
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from optiml.server import Server
    from conftest import live_server

    srv = Server(optiml.Model(smollm2_path, n_ctx=128, n_seq=1, n_threads=2), n_parallel=1)
    body = {"messages": [{"role": "system", "content": "Be brief."}] + MSGS, "max_tokens": 2}
    with live_server(srv):
        want = {REFUSES: (400, "invalid_request_error", "chat_template_refused", "refuses these messages"),
                BLOCKED: (500, "server_error", "chat_template_error", "was blocked by the sandbox"),
                RENDER: (500, "server_error", "chat_template_error", "failed while rendering")}
        for source, (status, kind, code, words) in want.items():
            srv.model.chat_template = source
            for stream in (False, True):
                r = httpx.post(srv.url + "/v1/chat/completions", json=dict(body, stream=stream), timeout=60)
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert err["type"] == kind and err["code"] == code and words in err["message"]
                assert err["message"].startswith("the chat template of SmolLM2-135M-Instruct.Q4_1.gguf")
        srv.model.chat_template = None
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200  # the server goes on
        r = httpx.get(srv.url + "/metrics", timeout=60)
        assert 'optiml_requests_total{endpoint="chat",status="500"} 4.0' in r.text
