"""Streams the GGUF: metadata and every tensor's info first, then each tensor's data computed only when
it is written (load -> permute -> quantize -> write -> free), into a temporary file in the output's
folder that is renamed over the output only once complete."""

from __future__ import annotations

import os
import sys
import time
import warnings
from contextlib import contextmanager

import gguf
import numpy as np

from ..formats import quant
from ..util.atomic import atomic_output
from .errors import ConvertError


F16_MAX = 65504.0


def tensor_nbytes(shape: tuple, t: gguf.GGMLQuantizationType) -> int:
    info = quant.type_info(int(t))
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows * (shape[-1] // info.block_size) * info.type_size


def encode(x: np.ndarray, t: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 values as the bytes of type t (native, multithreaded quantizers); bytes (uint8) already
    of type t as they are."""
    if x.dtype == np.uint8:
        return x
    if t == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    return quant.quantize(x, int(t))


class Progress:
    """One line on stderr, rewritten as tensors finish: [done/total] name type, elapsed seconds."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.t0 = total, enabled and total > 0, time.perf_counter()
        self.tty = enabled and sys.stderr.isatty()

    def step(self, i: int, name: str, t) -> None:
        if not self.enabled:
            return
        line = f"[{i:4d}/{self.total}] {name:32s} {t.name:5s} {time.perf_counter() - self.t0:6.1f} s"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if i == self.total else ""))
        elif i == self.total or i % max(1, self.total // 20) == 0:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def write_gguf(out: str, arch: str, add_metadata, tensors: list, progress: bool = True) -> None:
    """tensors: (name, shape, ggml type, compute) where compute() returns float32 values of shape.
    add_metadata(writer) adds the key/values. The output appears only when everything is written and on
    disk; a write that fails (a full disk) raises ConvertError naming the output, and leaves no file."""
    out = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConvertError(f"{out}: the output folder {folder} does not exist")
    nbytes = sum(tensor_nbytes(shape, t) for _, shape, t, _ in tensors)
    with atomic_output(out) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            add_metadata(w)
            for name, shape, t, _ in tensors:
                w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(shape, t), raw_dtype=t)
            with _writing(out, nbytes):
                w.write_header_to_file()
                w.write_kv_data_to_file()
                w.write_ti_data_to_file()
            bar = Progress(len(tensors), progress)
            for i, (name, shape, t, compute) in enumerate(tensors, 1):
                values = compute()
                if t == gguf.GGMLQuantizationType.F16 and values.dtype == np.float32 and values.size and \
                        max(values.max(), -values.min()) > F16_MAX:
                    warnings.warn(f"{name} has values beyond f16's range (+-{F16_MAX:.0f}), written as inf: "
                                  "convert with --type bf16 or f32 to keep them", stacklevel=2)
                data = encode(values, t)
                del values
                with _writing(out, nbytes):
                    w.write_tensor_data(data)
                del data
                bar.step(i, name, t)
            with _writing(out, nbytes):
                w.close()  # (flushes: a full disk may be said only now)
                # On disk before the rename, so that a crash after it cannot leave a file of holes under
                # the output's name (as formats/gguf_edit.py's rewrite does).
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
        finally:
            try:
                w.close()  # (after a failure: closes what is left, the error raised is the first one)
            except OSError:
                pass


@contextmanager
def _writing(out: str, nbytes: int):
    """An OSError while writing (ENOSPC, EFBIG, EIO: numpy's tofile says only "N requested and M written")
    as a ConvertError that names the output, which the temporary file's name would not, and what to do."""
    try:
        yield
    except OSError as e:
        reason = f"{e.strerror} [errno {e.errno}]" if e.strerror else f"a short write ({e})"
        size = f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
        raise ConvertError(f"{out}: cannot write the GGUF file: {reason}. It needs about {size} "
                           f"in {os.path.dirname(os.path.abspath(out))}: free space there (or lift a file-size "
                           "limit: ulimit -f), or give an output path on another disk; no partial file was "
                           "left") from e
