"""optiml convert: a Hugging Face model folder to GGUF (optiml.convert)."""

from __future__ import annotations

import os
import sys
import time

from .._core import ArgumentError
from ..convert import SUPPORTED_ARCHITECTURES, ConvertError, _check_not_an_input, convert
from ..convert.quant_mix import TYPES


def add_arguments(p) -> None:
    p.description = f"Convert a Hugging Face model folder to GGUF. Architectures: {SUPPORTED_ARCHITECTURES}."
    p.add_argument("hf_dir", help="folder with config.json, *.safetensors and the tokenizer files")
    p.add_argument("-o", "--outfile", required=True, help="GGUF file to write")
    p.add_argument("--type", default="f16", type=str.lower, choices=list(TYPES),
                   help="output type (default f16; any case)")
    p.add_argument("--name", help="the model's name in the file (general.name; default: the folder's name, or "
                                  "for a Hugging Face cache's snapshot, models--ORG--NAME/snapshots/COMMIT, NAME)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")


def run(args) -> int:
    if not os.path.isdir(args.hf_dir):  # bad input (exit status 2), before any work
        raise ArgumentError(f"{args.hf_dir}: not a folder (a Hugging Face model folder is expected)")
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise ArgumentError(f"{args.hf_dir}: no config.json (a Hugging Face model folder is expected)")
    try:  # an output that is a file of the checkpoint: bad input (exit status 2), as the other commands say it
        _check_not_an_input(args.hf_dir, args.outfile)
    except ConvertError as e:
        raise ArgumentError(str(e)) from None
    t0 = time.perf_counter()
    convert(args.hf_dir, args.outfile, type=args.type, progress=not args.quiet, name=args.name)
    if not args.quiet:
        size = os.path.getsize(args.outfile)
        print(f"wrote {args.outfile} ({args.type}, {size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    return 0
