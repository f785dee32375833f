"""gpt-oss's answers in OpenAI's harmony format, split into reasoning and content as text streams in.

After the chat template's ``<|start|>assistant``, gpt-oss writes messages framed by markers, e.g.

    <|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!

The tokenizer renders those markers as text for a harmony vocabulary (as llama.cpp does), and
``HarmonySplitter`` turns the stream into ``(kind, text)`` pieces: ``"reasoning"`` for the analysis channel,
``"content"`` for the final channel (and for a commentary preamble addressed to nobody). A tool call
(``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``) is kept apart in
``tool_calls`` (its header and arguments) and shown as neither: OptiML's server does not offer tools.
Text before any marker is content, so a model that answers without the frame loses nothing. Markers and
headers never reach the user; a marker cut between two chunks waits for the next one (or ``flush``).
"""

from __future__ import annotations

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")


def is_harmony(tokenizer) -> bool:
    """Whether a tokenizer's vocabulary is harmony's (the markers that frame gpt-oss's messages)."""
    return all(tokenizer.token_id(m) >= 0 for m in ("<|channel|>", "<|message|>", "<|return|>"))


class HarmonySplitter:
    def __init__(self):
        self._pending = ""  # text that may be the start of a marker
        self._header = None  # the header being read (after <|start|> or <|channel|>), or None in a body
        self._kind = "content"  # where the current body goes: "reasoning", "content", "tool", or None (dropped)
        self.tool_calls: list[tuple[str, str]] = []  # (header, arguments) of each tool call

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces of user-visible text that `text` completes, in order."""
        s = self._pending + text
        self._pending = ""
        out: list[tuple[str, str]] = []
        i = 0
        while i < len(s):
            j = s.find("<|", i)
            if j < 0:
                k = s.rfind("<", i)  # a last "<" may begin a marker the next chunk completes
                if k >= 0 and k == len(s) - 1:
                    self._text(s[i:k], out)
                    self._pending = "<"
                else:
                    self._text(s[i:], out)
                break
            self._text(s[i:j], out)
            marker = next((m for m in MARKERS if s.startswith(m, j)), None)
            if marker is None:
                if any(m.startswith(s[j:]) for m in MARKERS):  # cut off: wait for the rest
                    self._pending = s[j:]
                    break
                self._text("<|", out)  # not a marker: ordinary text
                i = j + 2
                continue
            self._marker(marker)
            i = j + len(marker)
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is left at the end of the stream (a cut-off marker's text is text after all)."""
        out: list[tuple[str, str]] = []
        s, self._pending = self._pending, ""
        self._text(s, out)
        return out

    def _text(self, t: str, out: list) -> None:
        if not t:
            return
        if self._header is not None:
            self._header += t
        elif self._kind == "tool":
            self.tool_calls[-1] = (self.tool_calls[-1][0], self.tool_calls[-1][1] + t)
        elif self._kind is not None:
            if out and out[-1][0] == self._kind:
                out[-1] = (self._kind, out[-1][1] + t)
            else:
                out.append((self._kind, t))

    def _marker(self, m: str) -> None:
        if m in ("<|start|>", "<|channel|>"):  # a header follows: the role, then the channel
            self._header = "" if m == "<|start|>" or self._header is None else self._header + " "
        elif m == "<|constrain|>":  # part of a tool call's header
            self._header = (self._header or "") + " <|constrain|>"
        elif m == "<|message|>":
            header, self._header = (self._header or "").strip(), None
            if "to=" in header:
                self._kind = "tool"
                self.tool_calls.append((header, ""))
            elif "analysis" in header.split():
                self._kind = "reasoning"
            else:  # final, a commentary preamble, or no channel named
                self._kind = "content"
        else:  # <|end|>, <|return|>, <|call|>: the message is over; stray text until the next one is dropped
            self._header, self._kind = None, None


def split(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole answer: what the chat route and Model.chat's callers need."""
    sp = HarmonySplitter()
    got = {"reasoning": "", "content": ""}
    for kind, t in sp.feed(text) + sp.flush():
        got[kind] += t
    return got["reasoning"], got["content"]
