"""optiml embed: embeddings of texts (llama.cpp's llama-embedding): each text's final hidden states pooled."""

from __future__ import annotations

import json
import sys

from ..engine.embeddings import POOLINGS
from . import common


def add_arguments(p) -> None:
    common.add_model_args(p)
    common.add_batch_arg(p)
    common.add_device_args(p)
    p.add_argument("-p", "--prompt", action="append", default=None,
                   help="a text to embed, each of its lines one text as llama-embedding splits them (repeat for more; "
                   "default: each line of --file, else of stdin)")
    p.add_argument("-f", "--file", help="a file whose non-empty lines are the texts")
    p.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="mean, cls (the first token's), last (the last token's) or none (every token's); default "
                   "the file's pooling_type, else mean")
    p.add_argument("--no-normalize", dest="normalize", action="store_false",
                   help="leave the vectors at their length (default: unit vectors, as /v1/embeddings gives)")
    p.add_argument("--embd-output-format", dest="output", choices=("text", "array", "json"), default="text",
                   help="text: one line of numbers per embedding; array: one JSON list of them; json: OpenAI's "
                   "{\"object\": \"list\", \"data\": [...]} (llama-embedding's names)")


def _texts(args) -> list[str]:
    if args.prompt:
        return [line for p in args.prompt for line in p.split("\n") if line.strip()]
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    else:
        lines = sys.stdin.read().splitlines()
    return [line for line in lines if line.strip()]


def run(args) -> int:
    texts = _texts(args)
    if not texts:
        raise common.ArgumentError("no text to embed: give -p TEXT, --file FILE or lines on stdin")
    with common.load(args) as m:
        out = m.embed(texts, pooling=args.pooling, normalize=args.normalize)
    vectors = [v.tolist() for v in out]
    if args.output == "json":
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        print(json.dumps({"object": "list", "data": data}))
    elif args.output == "array":
        print(json.dumps(vectors))
    else:
        for v in vectors:
            rows = v if args.pooling == "none" or (v and isinstance(v[0], list)) else [v]
            for row in rows:
                print(" ".join(f"{x:.6g}" for x in row))
    return 0
