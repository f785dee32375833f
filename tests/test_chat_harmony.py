"""optiml chat with a gpt-oss (harmony) model: the reasoning shown apart (dimmed on a terminal), the answer as
usual, only the answer kept in the conversation. The model is a stub streaming a scripted answer whose
markers are cut between pieces, as a detokenizer may deliver them."""

import io

import pytest

from optiml.cli.chat import repl

CHUNKS = ["<|channel|>analysis<|mess", "age|>The user greets.<|end|><|start|>assistant",
          "<|channel|>final<|message|>Hello!", " How can I help?"]
DIM, UNDIM = "\x1b[2m", "\x1b[0m"


class StubTokenizer:
    def __init__(self, is_harmony):
        self.is_harmony = is_harmony

    def token_id(self, text):  # what optiml.engine.harmony.is_harmony asks
        return 7 if self.is_harmony else -1


class StubTemplate:
    fallback = False


class StubModel:
    path, n_ctx, n_past = "stub.gguf", 4096, 0
    chat_template = StubTemplate()

    def __init__(self, is_harmony, interrupt_first=False):
        self.tokenizer = StubTokenizer(is_harmony)
        self.interrupt_first = interrupt_first  # Ctrl-C in the first answer's reasoning
        self.seen = []  # the messages of each turn

    def chat_prompt(self, messages):
        return [1, 2, 3]

    def chat(self, messages, stream=True, **kw):
        self.seen.append([dict(m) for m in messages])
        for i, c in enumerate(CHUNKS):
            if self.interrupt_first and len(self.seen) == 1 and i == 2:
                raise KeyboardInterrupt
            yield c

    def reset(self):
        pass


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(model, out):
    lines = iter(["Hi", "Again"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert repl(model, out=out, read=read) == 0
    return out.getvalue()


@pytest.fixture(autouse=True)
def colour_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)


def test_reasoning_dimmed_answer_kept():
    m = StubModel(True)
    text = run(m, Terminal())
    assert f"{DIM}The user greets.{UNDIM}\n\nHello! How can I help?\n" in text
    assert "<|" not in text and "analysis" not in text and "final" not in text
    # The second turn's prompt holds the first answer's final channel only.
    assert m.seen[1][1] == {"role": "assistant", "content": "Hello! How can I help?"}


@pytest.mark.parametrize("env", [{}, {"TERM": "dumb"}, {"NO_COLOR": "1"}], ids=["pipe", "dumb", "no_color"])
def test_reasoning_plain_without_colour(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = io.StringIO() if not env else Terminal()
    text = run(StubModel(True), out)
    assert "The user greets.\n\nHello! How can I help?\n" in text and "\x1b" not in text


def test_interrupted_reasoning_leaves_no_dim_and_is_forgotten():
    m = StubModel(True, interrupt_first=True)
    text = run(m, Terminal())
    assert "[stopped" in text and text.count(DIM) == text.count(UNDIM)
    assert m.seen[1] == [{"role": "user", "content": "Again"}]  # the stopped exchange is not in the prompt


def test_other_models_unchanged():
    m = StubModel(False)
    text = run(m, Terminal())
    assert "".join(CHUNKS) + "\n\n" in text and "\x1b" not in text
    assert m.seen[1][1] == {"role": "assistant", "content": "".join(CHUNKS)}
