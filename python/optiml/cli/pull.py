"""optiml pull: fetch known models or Hugging Face GGUFs into the cache (checksum checked); list the known."""

from __future__ import annotations

from .._core import ArgumentError
from ..hub import huggingface
from ..hub import registry
from . import common


def add_arguments(p) -> None:
    p.add_argument("names", nargs="*", help="known model names or Hugging Face references (org/repo:Q4_K_M, "
                   "org/repo/FILE.gguf); none, or --list: list the known models")
    p.add_argument("--list", action="store_true", help="list the known models and whether they are cached")
    p.add_argument("-f", "--force", action="store_true", help="fetch again even when cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines")


def run(args) -> int:
    if args.list or not args.names:
        print(f"known models (cache: {registry.cache_dir()}):")
        for mid, e in registry.manifest().items():
            names = ", ".join([*e.get("aliases", []), mid])
            state = "cached" if registry.is_cached(mid) else "not cached"
            print(f"  {names:55s} {e['size'] / 2**20:7.1f} MiB  {state}")
        return 0
    for n in args.names:
        if registry.lookup(n) is None and huggingface.parse(n) is None:
            raise ArgumentError(f"unknown model {n!r}; known: {', '.join(registry.known())}; or a Hugging Face "
                                "reference: org/repo:QUANT, org/repo/FILE.gguf")
    for n in args.names:
        print(registry.pull(n, force=args.force, quiet=common.quiet))
    return 0
