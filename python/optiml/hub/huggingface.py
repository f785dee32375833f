"""Models from the Hugging Face Hub: `org/repo:QUANT` and `org/repo/path/file.gguf` references.

    from optiml.hub import huggingface as hub
    ref = hub.parse("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    path = hub.pull(ref)          # downloaded into huggingface_hub's shared cache, sha256 checked
    path = hub.resolve(ref)       # the cached file without touching the network, else pull

Files go to huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), so
other tools see the same copy; huggingface_hub resumes an interrupted download. Each downloaded file's
sha256 is compared with the one the Hub lists for it (its LFS object id). With HF_HUB_OFFLINE=1, or when
the Hub cannot be reached, references are resolved from that cache alone.

A quant tag picks the GGUF whose name carries it as a whole word (``:Q4_K_M`` matches
``model-Q4_K_M.gguf`` and ``Q4_K_M/model-Q4_K_M-00001-of-00002.gguf``, not ``model-Q4_K_M_L.gguf``);
without a tag a repository with one model file gives that file, else its Q4_K_M, as llama.cpp's ``-hf``
does. A split GGUF (``NAME-00001-of-00003.gguf``) is followed: every part is downloaded and the first
part's path is returned (the loader then says that it reads single files only; see native/src/model/load.cpp).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .._core import ArgumentError, OptimlError
from .checksum import ChecksumError, sha256_of  # a download whose sha256 is not the one the Hub lists for it

__all__ = ["HubRef", "parse", "looks_like_ref", "match_files", "cache_dir", "cached_files", "pull", "resolve"]

DEFAULT_TAG = "Q4_K_M"  # what llama.cpp's -hf picks when no tag is given
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_RE = re.compile(rf"^(?:hf://|hf\.co/|huggingface\.co/)?({_NAME})/({_NAME})(?::([A-Za-z0-9._-]+))?$")
_FILE_RE = re.compile(rf"^(?:hf://|hf\.co/|huggingface\.co/)?({_NAME})/({_NAME})/((?:[^/:]+/)*[^/:]+\.gguf)$",
                      re.IGNORECASE)
_SPLIT_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: a repository plus either a quant tag or a file path inside it."""

    repo: str  # org/name
    tag: str | None = None  # Q4_K_M, ...
    file: str | None = None  # a path inside the repository

    def __str__(self) -> str:
        return f"{self.repo}/{self.file}" if self.file else f"{self.repo}:{self.tag}" if self.tag else self.repo


def parse(s: str) -> HubRef | None:
    """The Hub reference `s` names, or None when it is not one (a file path, a known model name).

    ``org/repo``, ``org/repo:TAG``, ``org/repo/dir/file.gguf``; an ``hf://``, ``hf.co/`` or ``huggingface.co/``
    prefix is allowed. Something that starts like a path (``/``, ``./``, ``~``) or whose first part is a folder
    here is not a reference."""
    s = str(s).strip()
    if not s or s.startswith(("/", ".", "~")) or "\\" in s:
        return None
    first = s.split("/", 1)[0]
    if "://" not in s and os.path.isdir(first):
        return None  # models/foo.gguf: a path under a folder of this directory
    if m := _FILE_RE.match(s):
        return HubRef(f"{m[1]}/{m[2]}", file=m[3])
    if (m := _REPO_RE.match(s)) and not m[2].lower().endswith(".gguf"):
        return HubRef(f"{m[1]}/{m[2]}", tag=m[3])
    return None


def looks_like_ref(s: str) -> bool:
    return parse(s) is not None


def split_parts(path: str) -> list[str] | None:
    """All part names of a split GGUF given any one of them (NAME-0000k-of-0000n.gguf), else None."""
    m = _SPLIT_RE.match(path)
    if not m:
        return None
    n = int(m[3])
    return [f"{m[1]}-{i:05d}-of-{m[3]}.gguf" for i in range(1, n + 1)]


def _tag_matches(path: str, tag: str) -> bool:
    """True when `tag` is a whole word of the path: bounded by start, '-', '.', '/' or the end ('_' is part
    of tags, so Q4_K does not match Q4_K_M)."""
    m = _SPLIT_RE.match(path)
    stem = m[1] if m else path[:-5] if path.lower().endswith(".gguf") else path
    return re.search(rf"(?:^|[-./]){re.escape(tag)}(?=$|[-./])", stem, re.IGNORECASE) is not None


def _is_model_file(path: str) -> bool:
    """GGUF files that hold a language model (not a vision projector, not a later split part)."""
    name = PurePosixPath(path).name.lower()
    if not name.endswith(".gguf") or "mmproj" in name:
        return False
    m = _SPLIT_RE.match(path)
    return m is None or int(m[2]) == 1


def match_files(ref: HubRef, files: list[str]) -> list[str]:
    """The repository paths `ref` needs, from the repository's file list: one file, or every part of a split
    GGUF (first part first). Raises ArgumentError saying what is there when nothing or several things match."""
    if ref.file:
        want = ref.file
        if want not in files:
            raise ArgumentError(f"{ref.repo} has no file {want}; its GGUF files: {_listing(files)}")
    else:
        models = [f for f in files if _is_model_file(f)]
        if not models:
            raise ArgumentError(f"{ref.repo} holds no GGUF model file (files: {_listing(files, gguf_only=False)})")
        if ref.tag:
            hits = [f for f in models if _tag_matches(f, ref.tag)]
            if not hits:
                raise ArgumentError(f"{ref.repo} has no GGUF tagged {ref.tag}; choose one of: {_tags(models)} "
                                    f"(or name a file: {ref.repo}/FILE.gguf)")
        elif len(models) == 1:
            hits = models
        else:
            hits = [f for f in models if _tag_matches(f, DEFAULT_TAG)]
            if not hits:
                raise ArgumentError(f"{ref.repo} holds several GGUF models; choose one with a tag, e.g. "
                                    f"{ref.repo}:{_tags(models).split(', ')[0]} (tags: {_tags(models)})")
        if len(hits) > 1:
            raise ArgumentError(f"{ref} matches several files: {', '.join(hits)}; name one as {ref.repo}/FILE.gguf")
        want = hits[0]
    parts = split_parts(want)
    if parts is None:
        return [want]
    missing = [p for p in parts if p not in files]
    if missing:
        raise OptimlError(f"{ref.repo}: the split GGUF {parts[0]} lacks {', '.join(missing)}")
    return parts


def _tags(models: list[str]) -> str:
    """The quant-looking words of the model file names, for error messages."""
    seen = []
    for f in models:
        m = _SPLIT_RE.match(f)
        stem = m[1] if m else f[:-5]
        for w in re.split(r"[-./]", stem):
            if re.fullmatch(r"(?i)(i?q\d\w*|f16|bf16|f32|tq\d\w*)", w) and w not in seen:
                seen.append(w)
    return ", ".join(seen) or ", ".join(models)


def _listing(files: list[str], gguf_only: bool = True) -> str:
    shown = [f for f in files if f.lower().endswith(".gguf")] if gguf_only else files
    return ", ".join(shown[:20]) + (" ..." if len(shown) > 20 else "") if shown else "none"


# ---- the cache ------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """huggingface_hub's cache folder, read from the environment now (huggingface_hub reads it once, when it
    is first imported): $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "huggingface" / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _repo_folder(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def cached_files(repo: str, revision: str = "main") -> tuple[Path, list[str]] | None:
    """(snapshot folder, paths of the files in it) of the cached `revision` of `repo`, or None when the
    cache has no such snapshot. The layout is huggingface_hub's: models--ORG--NAME/refs/REVISION holds a
    commit hash, snapshots/HASH/ the files (links into blobs/, which are named by their sha256)."""
    folder = _repo_folder(repo)
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = folder / "snapshots" / commit
    if not snap.is_dir():
        return None
    files = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
    return snap, files


def _hub():
    """huggingface_hub, or an error saying how to get it."""
    try:
        import huggingface_hub
    except ImportError:
        raise OptimlError("models from the Hugging Face Hub need huggingface_hub: pip install 'optiml[hub]'") from None
    return huggingface_hub


def _silent_tqdm():
    """A tqdm class that draws nothing: huggingface_hub's download bars under --quiet."""
    from tqdm import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _say(quiet: bool):
    return (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))


def _verify_cached(snap: Path, path: str, expected: str | None) -> None:
    """Checks a cached file's sha256 against `expected`, or, offline, against the name of the blob it links
    to (huggingface_hub names a Git LFS blob by its sha256)."""
    p = snap / path
    if expected is None:
        blob = Path(os.path.realpath(p)).name
        if not re.fullmatch(r"[0-9a-f]{64}", blob):
            return  # not an LFS blob (a small file kept in git): nothing to compare with
        expected = blob
    got = sha256_of(p)
    if got != expected:
        raise ChecksumError(f"{p}: sha256 {got} is not the Hub's {expected}; the cached file is damaged: "
                            "pull it again with --force")


def _remote_files(hub, repo: str, revision: str) -> dict[str, str | None]:
    """{path: LFS sha256 or None} of every file of `repo` at `revision`, from the Hub: one request
    (model_info with the files' metadata), which fails at once when the Hub cannot be reached."""
    info = hub.HfApi().model_info(repo, revision=revision, files_metadata=True, timeout=30)
    out = {}
    for s in info.siblings or []:
        lfs = s.lfs
        out[s.rfilename] = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
    return out


def pull(ref: HubRef | str, force: bool = False, quiet: bool = False, revision: str = "main") -> Path:
    """Downloads the file(s) `ref` names into huggingface_hub's cache and returns the local path of the (first)
    model file. Every file's sha256 is checked against the Hub's, or, offline, against its blob's name.
    Offline (HF_HUB_OFFLINE=1, or the Hub unreachable) the cache alone answers."""
    ref = parse(ref) if isinstance(ref, str) else ref
    if ref is None:
        raise ArgumentError("not a Hugging Face reference (expected org/repo, org/repo:QUANT or org/repo/FILE.gguf)")
    say = _say(quiet)
    hub = _hub()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its warnings are not ours to print
    remote = None
    if not offline():
        try:
            remote = _remote_files(hub, ref.repo, revision)
        except hub.errors.RepositoryNotFoundError:
            raise ArgumentError(f"{ref}: no such repository on the Hugging Face Hub (or it is private: log in with "
                                "`hf auth login`); and no such local file") from None
        except (hub.errors.RevisionNotFoundError, hub.errors.GatedRepoError) as e:
            raise ArgumentError(f"{ref}: {str(e).splitlines()[0]}") from None
        except Exception as e:  # no network, a proxy, a server error: fall back to the cache
            say(f"{ref}: the Hub cannot be reached ({type(e).__name__}); looking in the cache {cache_dir()}")
    if remote is None:
        return _from_cache(ref, revision, quiet, verify=True)
    paths = match_files(ref, sorted(remote))
    out = []
    for path in paths:
        say(f"{ref}: {path}")
        try:
            local = hub.hf_hub_download(ref.repo, path, revision=revision, cache_dir=cache_dir(), force_download=force,
                                        tqdm_class=_silent_tqdm() if quiet else None)
        except Exception as e:
            raise OptimlError(f"{ref}: downloading {path} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                              " (run it again to resume)") from None
        expected = remote[path]
        if expected is not None:
            got = sha256_of(local)
            if got != expected:
                blob = Path(os.path.realpath(local))
                blob.unlink(missing_ok=True)
                Path(local).unlink(missing_ok=True)
                raise ChecksumError(f"{ref}: {path} has sha256 {got}, the Hub lists {expected}; the download "
                                    "was deleted, pull it again")
            say(f"{ref}: sha256 ok")
        out.append(Path(local))
    return out[0]


class NotCached(OptimlError):
    """A reference the Hub could not be asked about and the cache does not hold."""


def not_found(e: Exception) -> bool:
    """Whether `e` says a reference was found nowhere (rather than that finding or reading it failed)."""
    return isinstance(e, NotCached)


def _from_cache(ref: HubRef, revision: str, quiet: bool, verify: bool) -> Path:
    got = cached_files(ref.repo, revision)
    if got is None:
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
        raise NotCached(f"{ref} is not in the Hugging Face cache ({cache_dir()}) and {why}: pull it while online")
    snap, files = got
    paths = match_files(ref, files)
    if verify:
        for p in paths:
            _verify_cached(snap, p, None)
    _say(quiet)(f"{ref}: {snap / paths[0]} (from the cache)")
    return snap / paths[0]


def resolve(ref: HubRef | str, quiet: bool = False, revision: str = "main") -> str:
    """The local path of a reference's model file: the cached snapshot of `revision` when it has every file
    the reference needs (no network, no hashing: pull checked them), else pulled now."""
    ref = parse(ref) if isinstance(ref, str) else ref
    got = cached_files(ref.repo, revision)
    if got is not None:
        snap, files = got
        try:
            paths = match_files(ref, files)
        except OptimlError:
            paths = None
        if paths and all((snap / p).is_file() for p in paths):
            return str(snap / paths[0])
    if offline():
        return str(_from_cache(ref, revision, quiet, verify=False))
    if not quiet:
        print(f"{ref}: not in the Hugging Face cache yet ({cache_dir()}); pulling it now", file=sys.stderr)
    return str(pull(ref, quiet=quiet, revision=revision))
