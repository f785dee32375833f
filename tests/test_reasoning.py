"""Reasoning in <think> tags (Qwen3, DeepSeek-R1) split from the answer (optiml.engine.reasoning), whole and as
text streams in cut anywhere, and optiml chat showing it apart and keeping only the answer."""

import pytest

from optiml.engine.reasoning import ThinkSplitter, opened_by, split

ANSWER = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! A <think> here is the answer's text."
WANT = ("The user greets me.\nI greet back.", "Hello! A <think> here is the answer's text.")


def streamed(text, cut, opened=False):
    """split(), fed in pieces of `cut` characters."""
    sp = ThinkSplitter(opened)
    parts = []
    for i in range(0, len(text), cut):
        parts += sp.feed(text[i:i + cut])
    parts += sp.flush()
    assert all(t for _, t in parts)  # no empty pieces
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_split_whole_and_streamed(cut):
    assert split(ANSWER) == WANT
    assert streamed(ANSWER, cut) == WANT


@pytest.mark.parametrize("text,opened,want", [
    ("Hello there", False, ("", "Hello there")),  # no block: all answer
    ("  \n", False, ("", "")),
    ("<think>\nhalf way, cut by max_tokens", False, ("half way, cut by max_tokens", "")),
    ("the template opened it\n</think>\n\nAnswer", True, ("the template opened it", "Answer")),
    ("<think>\n\n</think>\n\nNo thoughts", False, ("", "No thoughts")),  # Qwen3 with thinking off
    ("<thinking is fun", False, ("", "<thinking is fun")),
    ("<thi", False, ("", "<thi")),  # a cut tag that never completes is text
])
def test_edge_cases(text, opened, want):
    assert split(text, opened) == want
    assert streamed(text, 1, opened) == want


def test_opened_by_the_prompt():
    assert opened_by("<|User|>Hi<|Assistant|><think>\n")
    assert not opened_by("<|im_start|>assistant\n")
    assert not opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")


class Tokenizer:
    def token_id(self, text):  # the think tags are tokens; harmony's markers are not
        return 9 if text in ("<think>", "</think>") else -1


class Template:
    fallback = False

    def render(self, messages, add_generation_prompt=True):
        return "<|im_start|>assistant\n"


class ThinkingModel:
    path, n_ctx, n_past = "qwen3.gguf", 4096, 0
    chat_template = Template()
    tokenizer = Tokenizer()

    def __init__(self):
        self.seen = []

    def chat_prompt(self, messages):
        return [1, 2, 3]

    def chat(self, messages, stream=True, **kw):
        self.seen.append([dict(m) for m in messages])
        yield from (ANSWER[i:i + 5] for i in range(0, len(ANSWER), 5))

    def reset(self):
        pass


def test_chat_shows_the_reasoning_apart_and_keeps_the_answer(monkeypatch):
    from test_chat_harmony import Terminal, run  # (two turns, "Hi" and "Again", on a terminal)

    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    m = ThinkingModel()
    text = run(m, Terminal())
    assert "<think>\n" not in text and "</think>" not in text
    joined = text.replace("\x1b[0m\x1b[2m", "")  # (each piece is dimmed on its own)
    assert f"\x1b[2m{WANT[0]}\x1b[0m\n\n{WANT[1]}\n" in joined
    assert m.seen[1][1] == {"role": "assistant", "content": WANT[1]}
