"""Chat templates: the model's own template rendered as transformers renders it, within limits.

    from optiml.engine.chat_template import ChatTemplate
    tpl = ChatTemplate.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    text = tpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Templates come from the GGUF key ``tokenizer.chat_template`` and are rendered with jinja2 exactly as
transformers' ``apply_chat_template`` does: a sandboxed immutable environment with trim_blocks and
lstrip_blocks, the ``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter that does not
escape HTML, and the variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``tools`` (None) plus any keywords given. A model without a template gets a fallback: ChatML
(``<|im_start|>role\\n...<|im_end|>``) when its vocabulary has the ``<|im_start|>`` token, otherwise plain
``User: ...`` / ``Assistant: ...`` lines (with ``\\nUser:`` as a stop string).

A template is code from whoever made the model file. Besides the sandbox (no attribute access to
internals, no mutation of the inputs, ``range`` capped by jinja2), rendering is bounded: at most
``MAX_OUTPUT_CHARS`` characters of output (also for a single ``*`` or ``**`` result) and
``MAX_RENDER_SECONDS`` of time (checked on every template line and call, so loops that print nothing
count too). A template over either limit raises ``TemplateLimitError``.

Every failure of a template ends as a ``ChatTemplateError`` (an ``OptimlError``; ``TemplateLimitError`` is
one) whose message names the template (the model file it came from) and the problem, and whose
``problem`` says which: "syntax" (it does not compile), "blocked" (the sandbox refused what it reached
for), "refused" (the template's own ``raise_exception``: it does not accept these messages), "render"
(it failed while rendering) or "limit".
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from collections.abc import Iterable, Mapping, Sequence

from .._core import ArgumentError, OptimlError
from ..formats import gguf
from .tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE", "PLAIN_TEMPLATE", "TemplateLimitError",
           "check_variables", "read_template"]

MAX_OUTPUT_CHARS = 1 << 20  # a prompt is a few hundred kB at most; a template writing more is broken or hostile
MAX_RENDER_SECONDS = 2.0  # real templates render in well under 10 ms


class ChatTemplateError(OptimlError):
    """A chat template that failed: it does not compile, the sandbox blocked it, it refused the messages,
    it failed while rendering, or it went past the limits. ``template``: which template (e.g. "the chat
    template of MODEL.gguf"); ``problem``: "syntax", "blocked", "refused", "render" or "limit"."""

    def __init__(self, message: str, template: str | None = None, problem: str = "render"):
        super().__init__(message)
        self.template = template
        self.problem = problem


def join_text_parts(parts: list) -> str | None:
    """OpenAI's content parts as their text joined; None when one is not a text part
    ({"type": "text", "text": str}): images and audio are not supported."""
    if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return None
    return "".join(p["text"] for p in parts)


# Names extra template variables may not set: those the renderer gives the template, and the functions of the
# template language (a value there would break the template).
RESERVED_NAMES = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "raise_exception",
                  "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace", "self", "loop",
                  "varargs", "kwargs", "caller"}  # (the last five: Jinja's own names inside a template)


def check_variables(variables) -> dict:
    """Extra variables for a template (llama.cpp's chat_template_kwargs: Qwen3's enable_thinking): a dict of
    names the template does not give itself; ArgumentError otherwise."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping) or not all(isinstance(k, str) for k in variables):
        raise ArgumentError(f"chat_template_kwargs must be a dict of variable names to values, got {variables!r}")
    taken = sorted(RESERVED_NAMES & variables.keys())
    if taken:
        raise ArgumentError(f"chat_template_kwargs may not set {taken[0]!r}: the template has its own")
    return dict(variables)


def check_messages(messages) -> list:
    """Copies of the messages a template renders; ArgumentError unless they are an iterable of dicts with a
    str "role" and a "content" that is a str, None or a list of text parts, or left out beside "tool_calls"
    (an assistant's tool call; more keys are the template's to read, as transformers' apply_chat_template
    lets them be). As optiml serve takes them: text parts ({"type": "text", "text": ...}, OpenAI's) become
    their text joined, and None "" (kept beside "tool_calls")."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ArgumentError('messages must be a list of {"role": ..., "content": ...} dicts, got '
                            f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ArgumentError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ArgumentError(f"messages[{i}]['role'] must be a str, got {m.get('role')!r:.60}")
        if "content" not in m and "tool_calls" not in m:  # (an assistant's tool call may go without content)
            raise ArgumentError(f"messages[{i}] has no 'content'")
        c = m.get("content")
        if not isinstance(c, (str, list, type(None))):
            raise ArgumentError(f"messages[{i}]['content'] must be a str (or a list of text parts), got {c!r:.60}")
        m = dict(m)
        if isinstance(c, list):
            m["content"] = join_text_parts(c)
            if m["content"] is None:
                raise ArgumentError(f"messages[{i}]['content']: only text parts ({{'type': 'text', 'text': str}}) "
                                    "are supported")
        elif c is None and "content" in m and "tool_calls" not in m:
            m["content"] = ""
        out.append(m)
    return out


class TemplateLimitError(ChatTemplateError):
    """A chat template produced too much output or ran too long (see MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS)."""

    def __init__(self, message: str, template: str | None = None, problem: str = "limit"):
        super().__init__(message, template, problem)


class TemplateRefused(Exception):
    """Raised by a template's raise_exception(message): it does not accept the conversation. render() turns
    it into a ChatTemplateError (problem "refused")."""


# What to do about a template that fails (by ChatTemplateError.problem).
_FIX = {
    "refused": "the template accepts other conversations (such as roles alternating user/assistant after one "
               "optional system message): change the messages",
    "other": "the template in the model file is broken or hostile: use another model file, or give a template of "
             "your own (Model.chat_template = TEMPLATE_TEXT)",
    "given": "fix the template given to Model.chat_template, or set it to None for the model file's",
}


def _why(e: BaseException) -> str:
    """An exception of jinja2 (or of the template's own code) as the problem's words."""
    import jinja2

    if isinstance(e, jinja2.TemplateSyntaxError):
        return f"line {e.lineno}: {e.message}" if e.lineno else str(e.message)
    text = str(e)
    return f"{type(e).__name__}: {text.rstrip('.')}" if text else type(e).__name__


class _Budget:
    """The limits of one render: checked from the template's own code through a trace function."""

    def __init__(self, max_chars: int, max_seconds: float):
        self.max_chars = max_chars
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self.active = True  # False once the render is over: frames left behind stop checking

    def check_time(self):
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {self.max_seconds:g} s; it loops too "
                                     "long or forever (the model file's template is broken or hostile)")

    def check_size(self, n: int, what: str = "output"):
        if n > self.max_chars:
            raise TemplateLimitError(f"the chat template: its {what} exceeds {self.max_chars} characters; the "
                                     "template is broken or hostile")


def _digit_runs(s: str) -> list[str]:
    return re.findall(r"\d+", s)


def _width_checked(f):
    def checked(*args, **kwargs):
        budget = _current_budget.get() or _Budget(MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS)
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > budget.max_chars:
                budget.check_size(abs(a), "width")
            if isinstance(a, str) and any(int(d) > budget.max_chars for d in _digit_runs(a)):
                budget.check_size(budget.max_chars + 1, "format width")
        return f(*args, **kwargs)

    for attr in ("jinja_pass_arg",):  # jinja2 marks filters that take the context or environment
        if hasattr(f, attr):
            setattr(checked, attr, getattr(f, attr))
    return checked


def _size_checked_join(join):
    def checked(seq):
        parts = list(seq)
        budget = _current_budget.get() or _Budget(MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS)
        budget.check_size(sum(len(p) if isinstance(p, str) else 0 for p in parts), "concatenated value")
        return join(parts)

    return checked


# The budget of the render running in this thread (the compiled template is shared between threads).
_current_budget: ContextVar[_Budget | None] = ContextVar("optiml_chat_budget", default=None)


def _sized(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


def _traced(budget: _Budget):
    """A sys.settrace function that checks the deadline on every line of template code (the code jinja2
    compiles a template into has the file name "<template>"), every ~64 events to keep it cheap."""
    count = [0]

    def local(frame, event, arg):
        count[0] += 1
        if count[0] & 63 == 0 and budget.active:
            budget.check_time()
        return local if budget.active else None

    def global_(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            budget.check_time()
            return local
        return None

    return global_

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] | trim + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateRefused(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        # `'x' * 10**9` or `10 ** 10 ** 10` would take the memory or the time in a single step that no
        # line check interrupts: both operators are computed here, refusing results past the limit.
        intercepted_binops = frozenset(["*", "**", "%", "+"])

        def call_binop(self, context, operator, left, right):
            budget = _current_budget.get() or _Budget(MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS)
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if _sized(a) and isinstance(b, int) and _sized(a) * b > budget.max_chars:
                        budget.check_size(_sized(a) * b, "repeated value")
            elif operator == "+" and _sized(left) and _sized(right):
                budget.check_size(_sized(left) + _sized(right), "concatenated value")
            elif operator == "%" and isinstance(left, str):  # printf widths: '%*s' % (10**9, x)
                args = right if isinstance(right, tuple) else (right,)
                if any(isinstance(a, int) and abs(a) > budget.max_chars for a in args) or any(
                        c.isdigit() and int(c) > budget.max_chars for c in _digit_runs(left)):
                    budget.check_size(budget.max_chars + 1, "formatted value")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 64:
                    raise TemplateLimitError(f"the chat template computes {left} ** {right}; exponents of integers "
                                             "are limited to 64")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            budget = _current_budget.get()
            if budget is not None:
                budget.check_time()
            # 'x'.ljust(10**9), '{:>1000000000}'.format(x): sizes given to a method, refused before it runs.
            limit = budget.max_chars if budget is not None else MAX_OUTPUT_CHARS
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
                    (budget or _Budget(limit, MAX_RENDER_SECONDS)).check_size(abs(a), "argument")
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            # '{:>1000000000}'.format(x): the width is in the string, refused when the method is looked up.
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                budget = _current_budget.get() or _Budget(MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS)
                if any(int(d) > budget.max_chars for d in _digit_runs(obj)):
                    budget.check_size(budget.max_chars + 1, "format width")
            return super().getattr(obj, attribute)

    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    # Filters whose width argument sizes the output: refuse widths past the limit before allocating.
    for name in ("center", "indent", "wordwrap", "truncate", "format"):
        env.filters[name] = _width_checked(env.filters[name])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    # `s ~ s` (jinja2's concatenation, which the sandbox cannot intercept) doubles a string per step: the
    # compiled template's own str_join/markup_join are replaced by ones that refuse results past the limit.
    namespace = template.root_render_func.__globals__
    for name in ("str_join", "markup_join"):
        if name in namespace:
            namespace[name] = _size_checked_join(namespace[name])
    return template


class ChatTemplate:
    """A jinja2 chat template with the special-token strings it may use.

    source: the template text. stop: extra stop strings generation needs with it (the plain fallback's).
    fallback: True when the model had no template of its own. name: where the template comes from (the
    model file's name), for error messages: see :attr:`what`. A template that does not compile raises
    ChatTemplateError (problem "syntax"; "limit" when it nests too deeply).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", stop: Sequence[str] = (),
                 fallback: bool = False, name: str | None = None, given: bool = False):
        self.source = source
        self.given = given  # the user's (Model.chat_template = ...), not the model file's: errors say so
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.stop = list(stop)
        self.fallback = fallback
        self.name = name
        try:
            self._template = _compile(source)
        except RecursionError:  # jinja2's parser recurses per nesting level: '{{{{{{...' (found by fuzzing)
            raise TemplateLimitError(f"{self.what} nests too deeply to compile; it is broken or hostile",
                                     self.what) from None
        except Exception as e:  # jinja2.TemplateSyntaxError, and whatever else its parser may raise
            raise ChatTemplateError(f"{self.what} does not compile ({_why(e)}); {self._fix}", self.what,
                                    "syntax") from None

    @property
    def _fix(self) -> str:
        return _FIX["given" if self.given else "other"]

    @property
    def what(self) -> str:
        """The template as error messages name it: "the chat template of MODEL.gguf", "the ChatML fallback
        chat template (MODEL.gguf has none)", or "the chat template" when it has no name."""
        if self.fallback:
            kind = "ChatML" if self.source == CHATML_TEMPLATE else "plain"
            return f"the {kind} fallback chat template" + (f" ({self.name} has none)" if self.name else "")
        return f"the chat template of {self.name}" if self.name else "the chat template"

    def __repr__(self) -> str:
        stop = f", stop strings {self.stop!r}" if self.stop else ""
        return f"<optiml ChatTemplate: {self.what}, {len(self.source)} characters{stop}>"

    @classmethod
    def for_tokenizer(cls, template: str | None, tokenizer, name: str | None = None, given: bool = False) -> ChatTemplate:
        """The template (None: the fallback) with the tokenizer's BOS/EOS text; name, given: see the class."""

        def text(i):
            return tokenizer.token_to_piece(i, True).decode("utf-8", "replace") if i is not None and i >= 0 else ""

        bos, eos = text(tokenizer.bos_id), text(tokenizer.eos_id)
        if template:
            return cls(template, bos, eos, name=name, given=given)
        if tokenizer.token_id("<|im_start|>") >= 0 and tokenizer.token_id("<|im_end|>") >= 0:
            return cls(CHATML_TEMPLATE, bos, eos, fallback=True, name=name)
        return cls(PLAIN_TEMPLATE, bos, eos, stop=["\nUser:"], fallback=True, name=name)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> ChatTemplate:
        return cls.for_tokenizer(read_template(path), Tokenizer.from_file(path), os.path.basename(os.fspath(path)))

    def render(self, /, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as the model's prompt text (what apply_chat_template(tokenize=False) gives).
        Any failure of the template raises ChatTemplateError (see the module doc)."""
        ctx = {"bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None}
        ctx.update(kwargs)
        ctx.update(messages=check_messages(messages), add_generation_prompt=add_generation_prompt)
        try:
            return self._render_limited(ctx, self.max_output_chars, self.max_render_seconds)
        except ChatTemplateError as e:  # the limits: named after this template
            text = str(e)
            if text.startswith("the chat template"):
                text = self.what + text[len("the chat template"):]
            else:
                text = f"{self.what}: {text}"
            raise type(e)(text, self.what, e.problem) from None
        except TemplateRefused as e:
            raise ChatTemplateError(f"{self.what} refuses these messages: {e}; {_FIX['refused']}", self.what,
                                    "refused") from None
        except Exception as e:  # the template's code failed: anything it raises is the template's failure
            from jinja2.exceptions import SecurityError

            if isinstance(e, SecurityError):
                why = str(e).rstrip(".")
                raise ChatTemplateError(f"{self.what} was blocked by the sandbox ({why}): it reaches for Python "
                                        f"internals; {self._fix}", self.what, "blocked") from None
            raise ChatTemplateError(f"{self.what} failed while rendering ({_why(e)}); {self._fix}", self.what,
                                    "render") from None

    # Class-level so a caller (or a test) can tighten them per template.
    max_output_chars = MAX_OUTPUT_CHARS
    max_render_seconds = MAX_RENDER_SECONDS

    def _render_limited(self, ctx: dict, max_chars: int, max_seconds: float) -> str:
        """The template rendered piece by piece (jinja2's generate), counting characters as they come
        and watching the clock from a trace function, so neither a flood nor an endless loop gets far.
        Under a debugger or coverage tool (another trace function is set) the time limit is not
        enforced: the size limits still are."""
        budget = _Budget(max_chars, max_seconds)
        previous_trace = sys.gettrace()
        if previous_trace is None:
            sys.settrace(_traced(budget))
        token = _current_budget.set(budget)
        pieces = self._template.generate(**ctx)
        try:
            parts, n = [], 0
            for piece in pieces:
                n += len(piece)
                budget.check_size(n)
                parts.append(piece)
                budget.check_time()
            return "".join(parts)
        except RecursionError:
            raise TemplateLimitError("the chat template recursed too deep (a macro calling itself without end)") from None
        finally:
            budget.active = False
            pieces.close()
            _current_budget.reset(token)
            if previous_trace is None:
                sys.settrace(None)


def read_template(path: str | os.PathLike) -> str | None:
    """``tokenizer.chat_template`` of a GGUF file, or None."""
    with gguf.open(path) as f:
        t = f.metadata.get("tokenizer.chat_template")
    if isinstance(t, bytes):
        try:
            t = t.decode("utf-8")
        except UnicodeDecodeError as e:
            where = f"the chat template of {os.path.basename(os.fspath(path))}"
            raise ChatTemplateError(f"{where} is not UTF-8 text (byte {e.start}): {_FIX['other']}", where,
                                    "syntax") from None
    return t or None
