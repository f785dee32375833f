#!/usr/bin/env python3
"""The one entry point of the benchmark suite: `python tools/bench/run.py NAME [args]` runs
tools/bench/NAME.py with those arguments, exactly as `python tools/bench/NAME.py [args]` would.
Without a NAME it lists the benchmarks with the first line of each one's docstring.

    python tools/bench/run.py                         # the list
    python tools/bench/run.py vs_llamacpp -p 16 -n 16 -r 1 --json out.json
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"run", "harness", "serving", "table"}  # the suite's own parts


def benchmarks() -> dict[str, str]:
    """name -> the first line of its docstring."""
    out = {}
    for p in sorted(HERE.glob("*.py")):
        if p.stem not in NOT_BENCHMARKS:
            doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""
            out[p.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def main() -> int:
    known = benchmarks()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip() + "\n")
        for name, line in known.items():
            print(f"  {name:<18} {line}")
        return 0
    name = sys.argv[1]
    if name not in known:
        print(f"unknown benchmark {name!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    path = HERE / f"{name}.py"
    sys.argv = [str(path), *sys.argv[2:]]  # the benchmark parses its own arguments
    runpy.run_path(str(path), run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
