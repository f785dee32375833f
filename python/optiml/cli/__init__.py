"""The `optiml` command: chat, pull, run, bench, perplexity, tokenize, info, convert, solve, system.

    optiml chat                                   # talk to smollm2-135m-instruct (pulled on first use)
    optiml pull gemma3-270m                       # fetch a known model into the cache
    optiml pull org/repo:Q4_K_M                   # or a GGUF from the Hugging Face Hub (org/repo/FILE.gguf too)
    optiml run -m MODEL.gguf -p "The capital of France is" -n 32
    optiml bench -m MODEL.gguf -t 2
    optiml perplexity -m MODEL.gguf -f text.txt --ctx 256
    optiml perplexity -m BASE.gguf -f text.txt --ctx 256 --kl-divergence-base base.kld    # save the base
    optiml perplexity -m OTHER.gguf --kl-divergence-base base.kld --kl-divergence        # KLD against it
    optiml tokenize -m MODEL.gguf -p "Hello world"
    optiml embed -m MODEL.gguf -p "first text" -p "second text" --embd-output-format json
    optiml info MODEL.gguf [--plot curves.png] [--stats STATS.npz]
    optiml convert HF_DIR -o OUT.gguf --type q4_k_m
    optiml solve -m MODEL.gguf --stats STATS.npz --vram 6GiB -o PLACED.gguf
    optiml serve -m MODEL.gguf --parallel 4 --ctx 4096      # OpenAI-compatible API on 127.0.0.1:8080

Output for scripts: results on stdout, progress and logs on stderr (none with -q/--quiet, before or after
the command); `info`, `bench` and `perplexity` take --json (one JSON object on stdout). Exit status: 0 done,
2 bad input (arguments, missing files, unknown models), 1 a failure while running.

Level 7, the top: one module per command, each with add_arguments(parser) and run(args); COMMANDS below
lists them in the order --help shows. common holds what they share.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

from .._core import ArgumentError, ContextOverflowError, OptimlError
from .._version import __version__
from ..engine.sparsity import PredictorWarning
from . import (bench, calibrate, chat, common, convert, embed, hw, info, perplexity, profile, pull, run, serve, solve,
               system, tokenize, train_predictors)

__all__ = ["COMMANDS", "main"]

# (name, module, one-line help), in the order `optiml --help` lists them.
COMMANDS = (
    ("chat", chat, "talk with a model (interactive; /help inside)"),
    ("pull", pull, "fetch known models or Hugging Face GGUFs into the cache (checksum checked)"),
    ("run", run, "generate text from a prompt"),
    ("bench", bench, "prompt processing and generation speed (tokens/s)"),
    ("perplexity", perplexity, "perplexity of a text file (llama.cpp's convention); KL divergence against a saved "
                               "base model"),
    ("tokenize", tokenize, "show the tokens of a text"),
    ("embed", embed, "embeddings of texts (each text's final hidden states, pooled)"),
    ("info", info, "summary of a GGUF file"),
    ("convert", convert, "convert a Hugging Face model folder to GGUF"),
    ("profile", profile, "record how often each FFN neuron fires on sample text"),
    ("calibrate", calibrate, "per-layer sparsity thresholds for a target share of skipped neurons"),
    ("train-predictors", train_predictors, "train per-layer predictors of active FFN neurons (skip the gate too)"),
    ("solve", solve, "decide which FFN neurons go to the GPU (a MIP over activation stats)"),
    ("serve", serve, "OpenAI-compatible HTTP server with continuous batching"),
    ("hw", hw, "measure this machine for optiml solve: CPU product rates per weight type, and with --device a "
               "GPU's bandwidth, copy latency and sync cost"),
    ("system", system, "SIMD level, threads and CUDA devices of this build and machine"),
)


class _CommandParser(argparse.ArgumentParser):
    """A command's parser that refuses a single-dash word it does not know but that begins with one of its
    short options: llama.cpp's -mli or -no-cnv would otherwise be read as -m "li" (silently) or as -n with
    the value "o-cnv". (A value that starts with "-", given after its option, is a value.)"""

    def parse_known_args(self, args=None, namespace=None):
        words = list(sys.argv[1:] if args is None else args)
        takes_value = False
        for w in words:
            if w == "--":
                break
            if takes_value:  # the previous word's value, whatever it looks like
                takes_value = False
                continue
            name = w.split("=", 1)[0]
            action = self._option_string_actions.get(name)
            if action is not None:
                takes_value = action.nargs != 0 and "=" not in w
                continue
            if (w.startswith("-") and not w.startswith("--") and len(w) > 2 and not _is_number(w)
                    and w[:2] in self._option_string_actions):
                self.error(f"unrecognized argument: {w} (no such option here; {w[:2]} takes its value as the next "
                           f"argument: {w[:2]} VALUE)")
        return super().parse_known_args(args, namespace)


def _is_number(w: str) -> bool:
    try:
        float(w)
        return True
    except ValueError:
        return False


def parser() -> argparse.ArgumentParser:
    # No abbreviated options (allow_abbrev): llama.cpp's flags typed here must not pass for others of ours by
    # their first letters (--predict for --predictors).
    ap = argparse.ArgumentParser(prog="optiml", description="Run large language models fast on one machine.",
                                 allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"optiml {__version__}")
    ap.add_argument("-q", "--quiet", dest="quiet_all", action="store_true",
                    help="no progress or log lines on stderr (errors still go there)")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for name, module, summary in COMMANDS:
        p = sub.add_parser(name, help=summary, allow_abbrev=False)
        module.add_arguments(p)
        if "-q" not in p._option_string_actions:  # (-q after the command too, where the command has no -q of its own)
            p.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines on stderr")
        p.set_defaults(func=module.run)
    ap.command_parsers = sub.choices  # (main: a command's own errors)
    return ap


def _warning_line(command: str):
    """warnings.showwarning for a command: a warning as one line naming the command (not Python's file, line
    and source); a PredictorWarning (predictors found and left unused) as a log line, which -q silences."""
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, PredictorWarning):
            common.log(f"optiml {command}: {message}")
        else:
            print(f"optiml {command}: warning: {message}", file=sys.stderr)
    return show


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # said by the command's parser: its usage and name, not optiml's
        ap.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    common.quiet = args.quiet = args.quiet_all or getattr(args, "quiet", False)
    shown = warnings.showwarning
    warnings.showwarning = _warning_line(args.command)
    try:
        return args.func(args)
    except (ArgumentError, ContextOverflowError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        # Bad input: exit status 2, as argparse gives for a bad option.
        print(f"optiml {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader left (optiml info M | head): no error to report, nothing more to print
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the interpreter's own flush at exit)
        except (OSError, ValueError):  # stdout is not a file here (a caller that captured it)
            pass
        return 141
    except (OptimlError, OSError, subprocess.CalledProcessError) as e:
        print(f"optiml {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        warnings.showwarning = shown
