"""Reasoning in <think> ... </think> (Qwen3, DeepSeek-R1 and its distillations, QwQ), split from the answer as
text streams in.

Such a model thinks aloud between the two tags, then answers:

    <think>
    The user greets me.
    </think>

    Hello!

``ThinkSplitter`` turns the stream into ``(kind, text)`` pieces, ``"reasoning"`` between the tags and
``"content"`` after them, as llama.cpp's server splits them into ``reasoning_content`` and ``content``
(its reasoning format "deepseek"). Some chat templates open the block themselves (DeepSeek-R1's generation
prompt ends with ``<think>\\n``): ``opened_by(prompt)`` says so, and the splitter then starts inside it. Only
a block at the start of the answer is reasoning: a ``<think>`` later in the text is the answer's own text.
The tags never reach the user; a tag cut between two chunks waits for the next one (or ``flush``), and a
stream that ends inside the block (cut by max_tokens) leaves its text as reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def is_thinking(tokenizer) -> bool:
    """Whether a vocabulary has the think tags as tokens of their own (the models trained to use them)."""
    return tokenizer.token_id(OPEN) >= 0 and tokenizer.token_id(CLOSE) >= 0


def opened_by(prompt: str) -> bool:
    """Whether a rendered prompt leaves a think block open for the answer (its last tag is an opening one)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def _cut_tag(s: str, tag: str) -> int:
    """Where a tag that s's end may begin starts (len(s) when none): that text waits for the next chunk."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if tag.startswith(s[-k:]):
            return len(s) - k
    return len(s)


class ThinkSplitter:
    def __init__(self, opened: bool = False):
        # "start": before the answer's first text (a block may open); "reasoning": inside the block;
        # "content": the answer
        self._state = "reasoning" if opened else "start"
        self._pending = ""
        self._after_close = False  # the blank lines after </think> are the frame's, not the answer's
        self._said = False  # reasoning text given out yet

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces of user-visible text that `text` completes, in order."""
        s = self._pending + text
        self._pending = ""
        out: list[tuple[str, str]] = []
        while s:
            if self._state == "start":
                body = s.lstrip()
                if not body:  # only whitespace so far: the block may still open
                    self._pending = s
                    break
                if body.startswith(OPEN):
                    self._state, s = "reasoning", body[len(OPEN):]
                elif OPEN.startswith(body):  # cut off: wait for the rest
                    self._pending = s
                    break
                else:
                    self._state = "content"
                continue
            if self._state == "reasoning":
                if not self._said:  # the newline after <think> is the frame's
                    s = s.lstrip()
                    if not s:
                        break
                j = s.find(CLOSE)
                if j < 0:
                    k = _cut_tag(s, CLOSE)
                    k = len(s[:k].rstrip())  # whitespace that may end the block waits too
                    self._emit("reasoning", s[:k], out)
                    self._pending = s[k:]
                    break
                self._emit("reasoning", s[:j].rstrip(), out)
                self._state, self._after_close, s = "content", True, s[j + len(CLOSE):]
                continue
            if self._after_close:
                s = s.lstrip("\n")
                if not s:
                    break
                self._after_close = False
            self._emit("content", s, out)
            break
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is left at the end of the stream (a cut-off tag's text is text after all)."""
        out: list[tuple[str, str]] = []
        s, self._pending = self._pending, ""
        if self._state == "start":
            s = s.strip()
        elif self._state == "reasoning":
            s = s.rstrip() if self._said else s.strip()
        self._emit("reasoning" if self._state == "reasoning" else "content", s, out)
        return out

    def _emit(self, kind: str, text: str, out: list) -> None:
        if text:
            out.append((kind, text))
            self._said = self._said or kind == "reasoning"


def split(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole generated text."""
    sp = ThinkSplitter(opened)
    parts = sp.feed(text) + sp.flush()
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))
