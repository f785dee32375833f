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
    # Special-token text is parsed by default, as llama-tokenize and optiml run do.
    special = p.add_mutually_exclusive_group()
    special.add_argument("--no-parse-special", dest="special", action="store_false",
                         help="take special-token text such as <|im_start|> as plain text (default: that token)")
    special.add_argument("--special", dest="special", action="store_true",
                         help="parse special-token text (the default; kept for scripts)")
    p.set_defaults(special=True)


def run(args) -> int:
    tok = Tokenizer.from_file(common.model_arg(args.model))
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = tok.encode(text, add_special=not args.no_bos, parse_special=args.special)
    if args.ids:
        print(ids)
    else:
        for i in ids:  # the piece as text, as llama-tokenize prints it; a byte of a character as \xNN, and
            # control characters (a newline piece) escaped, so that each token stays one line
            text = tok.token_to_piece(i).decode("utf-8", "backslashreplace")
            print(f"{i:6d} -> '{''.join(c if c.isprintable() or c == ' ' else repr(c)[1:-1] for c in text)}'")
    return 0
