#!/usr/bin/env python3
"""Prints results files written by any benchmark's --json as markdown: for each, what ran (command,
commit, date, machine) and its rows as a table. The README's and docs/results' tables are made this way.

    python tools/bench/table.py results.json [more.json ...] [--columns model test ratio]
"""

from __future__ import annotations

import argparse
import json

import harness


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
    formats = {k: ".3g" for r in rows for k, v in r.items() if isinstance(v, float)}
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
