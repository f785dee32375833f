#!/usr/bin/env python3
"""Fetches reference models into the model cache: a thin wrapper over `optiml pull` (optiml.hub.registry).

Works from a checkout without installing or building the package: when optiml does not import, it
loads python/optiml/hub/registry.py alone (the registry is pure Python) with models/manifest.json.

    python tools/fetch_models.py smollm2-135m-instruct-q4_1    # one model (an id or alias from models/manifest.json)
    python tools/fetch_models.py --all                          # every model in the manifest
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from optiml.hub import registry as models
except ImportError:  # not installed or not built: the package's pure-Python modules without its __init__
    import types

    sys.modules.pop("optiml", None)
    _pkg = types.ModuleType("optiml")  # (which loads the native core); registry.py's relative imports
    _pkg.__path__ = [str(Path(__file__).resolve().parent.parent / "python" / "optiml")]  # (util, hub) work
    sys.modules["optiml"] = _pkg
    from optiml.hub import registry as models


def main() -> int:
    known = models.manifest()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"models to fetch: {', '.join(models.known())}")
    ap.add_argument("--all", action="store_true", help="fetch every model in the manifest")
    args = ap.parse_args()
    names = list(known) if args.all else args.names
    if not names:
        ap.error("name a model or pass --all")
    for n in names:
        if models.lookup(n) is None:
            ap.error(f"unknown model {n!r}; known: {', '.join(models.known())}")
    for n in names:
        try:
            print(models.pull(n))
        except (OSError, KeyError) as e:
            raise SystemExit(f"{n}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
