#!/usr/bin/env python3
"""Prints results files written by any benchmark's --json as markdown: for each, what ran (command,
commit, date, machine) and its rows as a table. The README's and docs/results' tables are made this way.

    python tools/bench/table.py results.json [more.json ...] [--columns model test ratio]
"""

from __future__ import annotations

import argparse
import json
import math

import harness


def figure(v: float) -> str:
    """A figure in plain fixed-point (never an exponent, which .3g wrote from 1000 up: 1176.6 as 1.18e+03):
    one decimal from 100 up, two from 1, three significant digits below 1 (0.957, 0.00312)."""
    if not math.isfinite(v):
        return "-"
    a = abs(v)
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1 or a == 0:
        return f"{v:.2f}"
    return f"{v:.{min(2 - math.floor(math.log10(a)), 12)}f}"


def render(doc: dict, columns: list[str] | None) -> str:
    m = doc.get("machine") or {}
    head = [f"### {doc['tool']}: `{doc['command']}`",
            f"commit {doc.get('commit')}, {doc.get('date')}; {m.get('cpu')}, {m.get('cores')} cores, "
            f"simd {m.get('simd')}, load average {m.get('load_average')}", ""]
    rows = doc["rows"]
    if columns:
        rows = [{c: r.get(c) for c in columns} for r in rows]
    # Lists (the single runs behind a median) stay in the JSON; the table shows the figures.
    rows = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
    formats = {k: figure for r in rows for k, v in r.items() if isinstance(v, float)}
    res = harness.Results(doc["tool"])
    return "\n".join(head + [res.table(rows, formats)] + [f"\n{n}" for n in doc.get("notes", [])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--columns", nargs="+", help="only these columns, in this order")
    a = ap.parse_args()
    for path in a.files:
        with open(path, encoding="utf-8") as f:
            print(render(json.load(f), a.columns) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
