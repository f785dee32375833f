"""optiml chat: talk with a model: a conversation fitted to the context, and the REPL around it (line editing,
history, /commands)."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

from .._core import ArgumentError
from ..engine.chat_template import ChatTemplateError
from ..engine.generation import make_sampler
from ..engine.harmony import HarmonySplitter, is_harmony
from ..engine.reasoning import ThinkSplitter, is_thinking, opened_by
from ..engine.sparsity import describe
from ..util import jsonout
from ..util.atomic import atomic_output
from ..util.paths import optiml_home
from . import common

__all__ = ["Conversation", "history_path", "repl"]


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file or known model name (default: smollm2-135m-instruct)")
    p.add_argument("-m", "--model", dest="model_opt", default=None, help=common.MODEL_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None,
                   help="context length in tokens (default: the model's, at most 4096)")
    p.add_argument("--sparsity", choices=("auto", "threshold", "none"), default="auto", help=common.SPARSITY_HELP)
    p.add_argument("--predictors", default="auto", help=common.PREDICTORS_HELP)
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None,
                   help="most tokens per answer (default, or -1: until done)")
    system = p.add_mutually_exclusive_group()
    system.add_argument("-s", "-sys", "--system", "--system-prompt", dest="system", default=None,
                        help="system message (llama.cpp's -sys; its -s, the seed, is --seed here)")
    system.add_argument("-sysf", "--system-prompt-file", dest="system_file", default=None, metavar="FILE",
                        help="the system message from a text file")
    template = p.add_mutually_exclusive_group()
    template.add_argument("--chat-template", default=None, metavar="JINJA",
                          help="a chat template's Jinja text instead of the model's (llama.cpp's built-in names "
                               "such as chatml are not known here)")
    template.add_argument("--chat-template-file", default=None, metavar="FILE",
                          help="a chat template (Jinja) from a file instead of the model's")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra variables for the chat template, as a JSON object (llama.cpp's; Qwen3: "
                        "'{\"enable_thinking\": false}' answers without thinking first)")
    p.add_argument("--stop", action="append", default=None, help="stop string besides the template's (repeatable)")
    common.add_device_args(p)
    common.add_batch_arg(p)
    common.add_sampling_args(p)


def run(args) -> int:
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ArgumentError(f"two models given ({args.model} and -m {args.model_opt}): give one")
    args.model = args.model_opt or args.model or "smollm2-135m-instruct"
    sampling = common.sampling(args)
    # Bad settings are said before the model loads, not at the first turn (no check reads the vocabulary's size).
    make_sampler(1, **{k: v for k, v in sampling.items() if k != "stop"})
    max_tokens = common.n_predict(args.n_predict)
    system = args.system
    if system is not None and system.lstrip("-").isdigit():
        common.log(f"optiml chat: -s {system} is the system message here (llama.cpp's -s is its seed: --seed)")
    if args.system_file is not None:
        system = _read_text(args.system_file, "--system-prompt-file")
    template = args.chat_template
    if template is not None and "{{" not in template and "{%" not in template:
        raise ArgumentError(f"--chat-template takes a template's Jinja text, not {template!r} (llama.cpp's "
                            "built-in template names are not known here); or --chat-template-file FILE")
    if args.chat_template_file is not None:
        template = _read_text(args.chat_template_file, "--chat-template-file")
    variables = common.template_variables(args.chat_template_kwargs)
    m = common.load(args)
    if template is not None:
        m.chat_template = template  # (ChatTemplateError, naming it, when it does not compile)
    interactive = sys.stdin.isatty()
    return repl(m, system=system, max_tokens=max_tokens, sampling=sampling, interactive=interactive,
                read=None if interactive else (lambda _prompt: input()), template_variables=variables)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ArgumentError(f"{flag}: no such file: {path}") from None
    except IsADirectoryError:
        raise ArgumentError(f"{flag}: {path} is a folder: give a text file") from None
    except UnicodeDecodeError:
        raise ArgumentError(f"{flag}: {path} is not UTF-8 text") from None


# ---- the conversation, fitted to the context --------------------------------------------------------
class Conversation:
    """Messages of a chat with a Model; drops the oldest turns (never the system message) when the
    conversation no longer fits the context."""

    def __init__(self, model, system: str | None = None, variables: dict | None = None):
        self.model = model
        self.variables = variables or {}  # the template's extra variables (--chat-template-kwargs)
        self.messages: list[dict] = []
        if system:
            self.messages.append({"role": "system", "content": system})

    def set_system(self, text: str) -> None:
        if self.messages and self.messages[0]["role"] == "system":
            self.messages[0]["content"] = text
        else:
            self.messages.insert(0, {"role": "system", "content": text})

    def reset(self) -> None:
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self.model.reset()

    def prompt_tokens(self, messages: list[dict] | None = None) -> int:
        return len(self.model.chat_prompt(self.messages if messages is None else messages,
                                          **({"chat_template_kwargs": self.variables} if self.variables else {})))

    def last_needs(self) -> int:
        """The prompt tokens of the last message with the system message alone (what fit() can keep at
        least): when they fill the context, no turn is dropped for it."""
        system = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        return self.prompt_tokens(system + self.messages[-1:])


    def fit(self, reserve: int) -> int:
        """Drops the oldest user/assistant turns until the prompt leaves ``reserve`` tokens free. Returns
        how many messages were dropped (the last user message is never dropped)."""
        dropped = 0
        limit = self.model.n_ctx - reserve
        while self.prompt_tokens() > limit:
            start = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            users = [i for i in range(start, len(self.messages)) if self.messages[i]["role"] == "user"]
            if len(users) < 2:
                break
            cut = users[1]  # remove the first turn: its user message and the answers up to the next user
            dropped += cut - start
            del self.messages[start:cut]
        return dropped


# ---- the REPL -------------------------------------------------------------------------------------
HELP = """\
Commands:
  /help            this text
  /reset           forget the conversation (keeps the system message) and empty the context
  /system TEXT     set the system message
  /stats           speed of the last answer and context use
  /save FILE       write the conversation to FILE (JSON)
  /load FILE       go on with a conversation /save wrote (it replaces this one)
  /exit            leave (also /bye, /quit, Ctrl-D)
Ctrl-C stops an answer; Ctrl-D at the prompt leaves. Up/Down browse the input history."""


def private_history(path: str, max_bytes: int = 1 << 20) -> None:
    """The input history file, readable by its owner only (what was typed, secrets pasted into prompts among it),
    cut to its newest entries (about max_bytes / 2) once it grows past max_bytes. A symlink is the user's own
    arrangement: left as it is."""
    if os.path.islink(path):
        return
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(path, 0o600)
    if os.path.getsize(path) <= max_bytes:
        return
    with open(path, "rb") as f:
        data = f.read()
    cut = data.find(b"\n# ", len(data) - max_bytes // 2)  # (prompt_toolkit starts each entry with "# <time>")
    if cut < 0:
        return
    tmp = f"{path}.pid{os.getpid()}.tmp"  # (0600 from the start, then over the old file at once)
    with os.fdopen(os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data[cut + 1:])
    os.replace(tmp, path)


def _reader(history_file: str | None) -> Callable[[str], str]:
    """A line reader with editing and history: prompt_toolkit on a terminal, else readline/input."""
    if sys.stdin.isatty() and sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb":
        try:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import FileHistory, InMemoryHistory

            hist = InMemoryHistory()
            if history_file:
                try:
                    os.makedirs(os.path.dirname(history_file), exist_ok=True)
                    private_history(history_file)
                    hist = FileHistory(history_file)
                except OSError:
                    pass
            session = PromptSession(history=hist)
            return lambda p: session.prompt(p)
        except Exception:  # no usable terminal for prompt_toolkit: fall back to readline
            pass
    try:
        import readline  # noqa: F401  (input() gains line editing and history)
    except ImportError:
        pass
    return input


ROLES = ("system", "user", "assistant", "tool")


def read_conversation(path: str) -> list[dict]:
    """The messages of a conversation /save wrote (or a JSON list of {"role", "content"} messages).
    OSError or ValueError, saying what is wrong, for anything else."""
    with open(path, "rb") as f:
        try:
            doc = json.loads(f.read())
        except (ValueError, RecursionError) as e:  # (RecursionError: nested past Python's limit)
            raise ValueError(f"{path} is not JSON ({e})") from None
    msgs = doc.get("messages") if isinstance(doc, dict) else doc
    if not isinstance(msgs, list):
        raise ValueError(f"{path} holds no conversation: a JSON object with \"messages\" (what /save writes) or a list")
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{path}: message {i} is not a {{\"role\": {'/'.join(ROLES)}, \"content\": text}} object")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def history_path() -> str:
    """$OPTIML_HOME/chat_history, else ~/.cache/optiml/chat_history."""
    return str(optiml_home() / "chat_history")


def repl(model, system: str | None = None, max_tokens: int | None = None, sampling: dict | None = None,
         out=None, read: Callable[[str], str] | None = None, reserve: int = 256, interactive: bool = True,
         template_variables: dict | None = None) -> int:
    """Runs the interactive chat on ``model`` until /exit or end of input. A chat template that fails on a
    turn is reported and the turn dropped; one that does not compile raises ChatTemplateError (optiml
    chat then exits with status 1 and the message). interactive False (input from a pipe): the greeting
    goes to stderr as a log line, so `out` carries the answers and what commands print."""
    out = out or sys.stdout
    sampling = dict(sampling or {})
    read = read or _reader(history_path())
    conv = Conversation(model, system, template_variables)
    reserve = min(max_tokens or reserve, model.n_ctx // 2)

    def say(s: str = "") -> None:
        out.write(s + "\n")
        out.flush()

    tpl = model.chat_template
    greeting = (f"optiml chat: {os.path.basename(model.path)} (context {model.n_ctx} tokens"
                f"{', fallback chat template' if tpl.fallback else ''}). /help for commands, /exit to leave.")
    if interactive:
        say(greeting)
    else:
        common.log(greeting)
    while True:
        try:
            line = read(">>> ")
        except KeyboardInterrupt:
            say("(Ctrl-D or /exit to leave)")
            continue
        except EOFError:
            say()
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd in ("/exit", "/bye", "/quit"):
                return 0
            elif cmd in ("/help", "/?"):
                say(HELP)
            elif cmd in ("/reset", "/clear"):
                conv.reset()
                say("Conversation cleared.")
            elif cmd == "/system":
                if not arg:
                    say("usage: /system TEXT")
                else:
                    conv.set_system(arg)
                    say("System message set.")
            elif cmd == "/stats":
                s = model.last_stats
                pp = s["prompt_evaluated"] / s["prompt_s"] if s["prompt_s"] > 0 else 0.0
                # The first token comes from the prompt's step: n tokens took n - 1 steps (llama.cpp's eval time).
                steps = s["gen_tokens"] - 1
                tg = f"{steps / s['gen_s']:.1f} tokens/s" if steps > 0 and s["gen_s"] > 0 else "- tokens/s"
                say(f"prompt: {s['prompt_tokens']} tokens, {s['prompt_evaluated']} new, {pp:.1f} tokens/s | "
                    f"answer: {s['gen_tokens']} tokens, {tg} | "
                    f"context: {model.n_past}/{model.n_ctx} tokens")
                sp = model.sparsity_stats()
                say(f"FFN: {describe(model.sparsity, model.predictors, model.sparsity_note)}; {sp['skipped']:.1%} of the neurons skipped "
                    f"over {sp['tokens']} tokens")
            elif cmd == "/save":
                if not arg:
                    say("usage: /save FILE")
                    continue
                try:
                    doc = {"model": model.path, "messages": conv.messages}
                    try:
                        data = jsonout.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8")
                    except UnicodeEncodeError:  # typed bytes that were not UTF-8: escaped, so the file stays JSON
                        data = jsonout.dumps(doc, indent=2, ensure_ascii=True).encode("ascii")
                    with atomic_output(os.path.expanduser(arg), suffix=".json") as tmp, open(tmp, "wb") as f:
                        f.write(data)
                    say(f"Saved {len(conv.messages)} messages to {arg}.")
                except OSError as e:
                    say(f"cannot save: {e}")
            elif cmd == "/load":
                if not arg:
                    say("usage: /load FILE")
                    continue
                try:
                    conv.messages = read_conversation(os.path.expanduser(arg))
                except (OSError, ValueError) as e:
                    say(f"cannot load: {e}")
                    continue
                say(f"Loaded {len(conv.messages)} messages from {arg}; the next answer goes on from them.")
            else:
                say(f"unknown command {cmd}; /help lists them")
            continue

        conv.messages.append({"role": "user", "content": line})
        try:
            _answer(model, conv, say, out, reserve, max_tokens, sampling)
        except ChatTemplateError as e:  # the template refused or failed on this conversation: say so, go on
            conv.messages.pop()
            say(f"[error: {e}]")
        except KeyboardInterrupt:  # before the answer began (the prompt being rendered): the turn is taken back
            if conv.messages and conv.messages[-1]["role"] == "user":
                conv.messages.pop()
            say()
            say("[stopped: the message was not sent]")


def _can_dim(out) -> bool:
    """Whether `out` takes ANSI dimming: a terminal, not TERM=dumb, and no NO_COLOR (no-color.org)."""
    tty = out.isatty() if hasattr(out, "isatty") else False
    return tty and os.environ.get("TERM", "") != "dumb" and not os.environ.get("NO_COLOR")


def _answer(model, conv: Conversation, say, out, reserve: int, max_tokens: int | None, sampling: dict) -> None:
    """One turn: the conversation (its last message the user's) fitted to the context and answered,
    streaming; the answer is appended. ChatTemplateError when the template fails on the conversation."""
    need = conv.last_needs()
    if need >= model.n_ctx:  # (before fit(): the turns it would drop could not make room)
        say(f"[the message does not fit in the context: {need} tokens with the template and the system message, "
            f"the context holds {model.n_ctx}; a shorter message, or a larger --ctx]")
        conv.messages.pop()
        return
    dropped = conv.fit(reserve)
    if dropped:
        say(f"[context full: dropped the {dropped} oldest messages]")
    pieces: list[str] = []
    if conv.variables:
        sampling = dict(sampling, chat_template_kwargs=conv.variables)
    gen = model.chat(conv.messages, stream=True, max_tokens=max_tokens, **sampling)
    # gpt-oss (harmony) and the models that think in <think> tags (Qwen3, DeepSeek-R1): the reasoning shown
    # dimmed on a terminal, only the answer kept for the next turn (their templates leave it out anyway).
    if is_harmony(model.tokenizer):
        split = HarmonySplitter()
    elif is_thinking(model.tokenizer):
        split = ThinkSplitter(opened_by(model.chat_template.render(conv.messages, add_generation_prompt=True,
                                                                   **conv.variables)))
    else:
        split = None
    dim = _can_dim(out)

    last = ["content"]

    def show(parts):
        for kind, text in parts:
            if kind == "content":
                if last[0] != "content":  # the answer on its own lines after the reasoning
                    out.write("\n\n")
                pieces.append(text)
                out.write(text)
            else:
                out.write(f"\x1b[2m{text}\x1b[0m" if dim else text)
            last[0] = kind
        out.flush()

    try:
        for piece in gen:
            show(split.feed(piece) if split else [("content", piece)])
        if split:
            show(split.flush())
    except KeyboardInterrupt:
        gen.close()
        say()
        say("[stopped: this exchange is left out of the conversation]")
        conv.messages.pop()
        return
    reply = "".join(pieces)
    conv.messages.append({"role": "assistant", "content": reply.strip() if model.chat_template.fallback else reply})
    if model.n_past >= model.n_ctx - 1:
        say()
        say("[context full: the answer was cut]")
    say()
    say()
