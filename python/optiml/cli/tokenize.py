"""optiml tokenize: the tokens of a text."""

from __future__ import annotations

import sys

from ..engine.tokenizer import Tokenizer
from . import common


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", required=True, help=common.MODEL_HELP)
    p.add_argument("-p", "--prompt", help="text (default: read stdin)")
    p.add_argument("--ids", action="store_true", help="print only the list of ids")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS/EOS the model asks for")
    p.add_argument("--special", action="store_true", help="parse special-token text such as <|im_start|>")


def run(args) -> int:
    tok = Tokenizer.from_file(common.model_arg(args.model))
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = tok.encode(text, add_special=not args.no_bos, parse_special=args.special)
    if args.ids:
        print(ids)
    else:
        for i in ids:
            print(f"{i:6d} -> {tok.token_to_piece(i)!r}")
    return 0
