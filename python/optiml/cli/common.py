"""What the commands share: the model argument and the options that load a model, -q/--quiet, --json output."""

from __future__ import annotations

import argparse
import os
import sys

from .._core import ArgumentError
from ..engine.model import Model
from ..hub.registry import resolve
from ..util import jsonout

MODEL_HELP = ("GGUF model file, a known model name (optiml pull --list) or a Hugging Face reference "
              "(org/repo:Q4_K_M, org/repo/FILE.gguf), pulled on first use")
SPARSITY_HELP = ("FFN neuron skipping: auto (the file's calibrated thresholds; exact zero-skipping for ReLU "
                 "models; else dense), threshold (the same, an error when there is nothing to skip by), none")
PREDICTORS_HELP = ("activation predictors (optiml train-predictors): auto (MODEL.predictors.gguf beside the model "
                   "when present, unless it marks so many neurons active that it would slow decoding down), none, "
                   "or a file")
THREADS_HELP = "CPU threads (default: physical cores)"

quiet = False  # -q/--quiet: no progress or log lines on stderr (set by main)


def model_arg(name: str) -> str:
    """The one resolver of model arguments: a path stays a path; a known name or a Hugging Face reference
    becomes its cached file. A name that is none of these is bad input (exit status 2)."""
    path = resolve(name, quiet=quiet)
    if not os.path.exists(path):
        raise ArgumentError(f"no such model file: {name} (give a GGUF file, a known model name: optiml pull "
                            "--list, or a Hugging Face reference: org/repo:QUANT or org/repo/FILE.gguf)")
    if os.path.isdir(path):
        raise ArgumentError(f"{name} is a folder: give a GGUF file (convert a Hugging Face folder with optiml convert)")
    return path


def check_output(out: str, inputs: list) -> None:
    """Errors about a command's output path, before any work: its folder must exist, it must not be a folder,
    and it must not be one of the command's input files (None: an input not given)."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ArgumentError(f"the output folder does not exist: {folder}")
    if os.path.isdir(out):
        raise ArgumentError(f"the output is a folder, not a file: {out}")
    for i in inputs:
        if i is not None and os.path.exists(i) and os.path.exists(out) and os.path.samefile(out, i):
            raise ArgumentError(f"the output {out} is an input file ({i}); choose another name")


def print_json(obj) -> None:
    """--json: one object on stdout (numpy values as plain numbers and lists; NaN and Infinity as null)."""
    print(jsonout.dumps(obj))


def log(*parts) -> None:
    """A progress or log line on stderr, unless -q/--quiet."""
    if not quiet:
        print(*parts, file=sys.stderr)


def add_model_args(p: argparse.ArgumentParser, ctx_default: int | None = None, required: bool = True) -> None:
    p.add_argument("-m", "--model", required=required, help=MODEL_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=ctx_default,
                   help="context length in tokens")
    p.add_argument("--sparsity", choices=("auto", "threshold", "none"), default="auto", help=SPARSITY_HELP)
    p.add_argument("--predictors", default="auto", help=PREDICTORS_HELP)


def add_data_args(p: argparse.ArgumentParser, what: str, required: bool = True) -> None:
    """-m MODEL, --data FILES (`what` they are for), --field: the offline commands that run a model over text."""
    p.add_argument("-m", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--data", nargs="+", required=required, default=None,
                   help=f"text files, or JSONL files with a text field, {what}")
    p.add_argument("--field", default="text", help="the JSONL field holding the text (default: text)")


def add_device_args(p: argparse.ArgumentParser, loads_weights: bool = True) -> None:
    if loads_weights:
        p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=None,
                       help="--mmap maps the model file; --no-mmap reads it into memory (2 MiB pages on Linux: "
                       "faster generation, slower load); default: into memory when the CPU runs every layer, "
                       "transparent huge pages are on and the file fits in half of the available memory")
    p.add_argument("--device", default="auto", help="auto (the CPU), cpu, cuda[:N] (a GPU, in a CUDA build) or "
                   "cpu:1 (a second CPU device treated as one, for testing split execution)")
    p.add_argument("--vram", default=None, help="device memory budget: bytes or a size (6GiB, 512MiB)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                   help="the last N layers whole on the device (as llama.cpp's -ngl)")
    p.add_argument("--gpu-neurons", type=int, default=None,
                   help="FFN neurons per layer on the device (overrides the file's placement)")
    moe = p.add_mutually_exclusive_group()
    moe.add_argument("--cpu-moe", action="store_true",
                     help="mixtures of experts: every layer's experts on the CPU, the rest where the plan puts it "
                     "(as llama.cpp's --cpu-moe)")
    moe.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=None, metavar="N",
                     help="mixtures of experts: the experts of the first N layers on the CPU (llama.cpp's --n-cpu-moe)")
    p.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE",
                   help="the KV cache's type for keys: f16 (default), f32, q8_0 (half the bytes), q4_0 (a quarter)")
    p.add_argument("-ctv", "--cache-type-v", default=None, metavar="TYPE", help="the same for values")


def add_batch_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--batch-size", "-ub", "--ubatch-size", dest="batch_size", type=int, default=None,
                   metavar="N", help="most prompt tokens per forward step (default 512; llama.cpp's -ub, which its "
                   "-b also caps): smaller needs less scratch memory (the --batch a placement was solved for)")


def add_sampling_args(p: argparse.ArgumentParser, seed_flags: tuple = ("--seed",)) -> None:
    """run's and chat's sampling options, with llama.cpp's names and defaults."""
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy; default 0.8)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty on repeated tokens (1.0: none)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back on (default 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument(*seed_flags, dest="seed", type=int, default=None, help="random seed (default, or -1: random)")


def sampling(args) -> dict:
    """Model.stream's sampling keywords from add_sampling_args' options (and --stop, where the command has it)."""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=seed(args.seed), stop=getattr(args, "stop", None))


def template_variables(text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object of extra chat template variables (llama.cpp's flag)."""
    if text is None:
        return {}
    import json

    from ..engine.chat_template import check_variables

    try:
        v = json.loads(text)
    except ValueError as e:
        raise ArgumentError(f"--chat-template-kwargs is not JSON ({e}): give an object such as "
                            "'{\"enable_thinking\": false}'") from None
    if not isinstance(v, dict):
        raise ArgumentError(f"--chat-template-kwargs must be a JSON object, not {text}")
    return check_variables(v)


def load(args, n_ctx: int | None = None) -> Model:
    """The Model the options ask for (a PredictorWarning, predictors found and left unused, is a log line:
    main's warning hook)."""
    m = Model(model_arg(args.model), n_ctx=n_ctx if n_ctx is not None else args.ctx, n_threads=args.threads,
              sparsity=getattr(args, "sparsity", "auto"), predictors=predictors(args), use_mmap=use_mmap(args),
              **batch_size(args), **device(args))
    say_what_the_cpu_ignores(args, m.plan)
    n_train = int(m.hparams.get("n_ctx_train") or 0)
    if n_train and m.n_ctx > n_train and getattr(args, "command", "") != "perplexity":  # (perplexity says it its own way)
        log(f"optiml: warning: the context ({m.n_ctx} tokens) is longer than the model was trained on ({n_train}): "
            "past that, expect poor text (llama.cpp's \"possible training context overflow\")")
    return m


def say_what_the_cpu_ignores(args, plan) -> None:
    """A log line when options that place work on a GPU had none to place it on (llama.cpp's -ngl on a machine
    without one): the run goes on, on the CPU, but the user hears why it is not on the GPU."""
    if plan.device not in ("cpu", "cpu:0"):
        return
    given = [flag for flag, attr in (("-ngl", "n_gpu_layers"), ("--gpu-neurons", "gpu_neurons"), ("--vram", "vram"),
                                     ("--cpu-moe", "cpu_moe"), ("-ncmoe", "n_cpu_moe"))
             if getattr(args, attr, None) not in (None, False)]
    if given:
        why = plan.reason.split(": n_gpu_layers / ")[0]  # (the plan's own reason goes on to say they were ignored)
        log(f"optiml: {', '.join(given)} ignored, the model runs on the CPU ({why or 'the device is the CPU'})")


def n_predict(n: int | None) -> int | None:
    """-n/--n-predict as llama.cpp takes it: -1 (or None) is until the end of generation or a full context."""
    if n is None or n == -1:
        return None
    if n < 0:
        raise ArgumentError(f"-n/--n-predict must be >= 0, or -1 for no limit; got {n}")
    return n


def seed(s: int | None) -> int | None:
    """--seed as llama.cpp takes it: -1 (or None) draws a random one."""
    return None if s is None or s == -1 else s


def batch_size(args) -> dict:
    """Model's n_batch from -b/--batch-size, when the command has it and it was given."""
    n = getattr(args, "batch_size", None)
    if n is None:
        return {}
    if n < 1:
        raise ArgumentError(f"-b/--batch-size must be >= 1, not {n}")
    return {"n_batch": n}


def use_mmap(args):
    """Model's use_mmap from --mmap / --no-mmap (absent: "auto")."""
    v = getattr(args, "mmap", None)
    return "auto" if v is None else v


def device(args) -> dict:
    """Model's keyword arguments for where layers run and the KV cache's types (the options of add_device_args)."""
    return {"device": getattr(args, "device", "auto"), "vram": getattr(args, "vram", None),
            "n_gpu_layers": getattr(args, "n_gpu_layers", None), "gpu_neurons": getattr(args, "gpu_neurons", None),
            "n_cpu_moe": True if getattr(args, "cpu_moe", False) else getattr(args, "n_cpu_moe", None),
            "kv_type_k": getattr(args, "cache_type_k", None), "kv_type_v": getattr(args, "cache_type_v", None)}


def predictors(args):
    p = getattr(args, "predictors", "auto")
    return None if p == "none" else p
