"""OptiML: run large language models fast on one machine.

Hot FFN neurons run on the GPU, cold ones on the CPU, and neurons predicted inactive are skipped.
"""

import sys

from . import _core
from ._version import __version__
from ._core import ArgumentError, ContextOverflowError, GGUFError, OptimlError, UnsupportedModelError
from .formats import gguf, quant
from .formats.predictors import PredictorMismatchError
from .engine import plan, sampling, tokenizer
from .engine.batch import Batch
from .engine.chat_template import ChatTemplateError, TemplateLimitError
from .engine.model import Model
from .engine.sparsity import PredictorWarning
from .offline.calibrate import calibrate
from .offline.predictors import train_predictors
from .offline.profile import profile


def _check_environment() -> None:
    """The environment settings the native core reads when it loads, and ignores when they make no sense: a
    warning names them, rather than a silent default."""
    import os
    import re
    import warnings

    simd = os.environ.get("OPTIML_SIMD")
    if simd is not None and simd not in ("scalar", "avx2", "avx512", "neon"):  # (a level above the CPU's: a cap)
        warnings.warn(f"OPTIML_SIMD={simd!r} is not a SIMD level (scalar, avx2, avx512, neon): ignored",
                      RuntimeWarning, stacklevel=3)
    threads = os.environ.get("OPTIML_NUM_THREADS")
    lead = re.match(r"\s*[+-]?[0-9]+", threads or "", re.ASCII)  # what the native side's atoi reads
    if threads is not None and not (lead and int(lead.group()) > 0):
        warnings.warn(f"OPTIML_NUM_THREADS={threads!r} is not a positive number of threads: ignored", RuntimeWarning,
                      stacklevel=3)
    elif lead and int(lead.group()) > _core.MAX_THREADS:
        warnings.warn(f"OPTIML_NUM_THREADS={threads!r} is more than {_core.MAX_THREADS} threads: "
                      f"{_core.MAX_THREADS} are used", RuntimeWarning, stacklevel=3)


_check_environment()

# The documented module names (optiml.gguf, optiml.quant, ...) of modules that live in the subpackages:
# attributes above, and `import optiml.gguf` finds them here.
for _m in (gguf, quant, sampling, tokenizer, plan):
    sys.modules[f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}"] = _m
del _m

__all__ = [
    "ArgumentError",
    "Batch",
    "ChatTemplateError",
    "ContextOverflowError",
    "Model",
    "calibrate",
    "profile",
    "train_predictors",
    "PredictorMismatchError",
    "PredictorWarning",
    "TemplateLimitError",
    "GGUFError",
    "OptimlError",
    "UnsupportedModelError",
    "get_num_threads",
    "gguf",
    "plan",
    "quant",
    "sampling",
    "tokenizer",
    "set_num_threads",
    "system_info",
]


def system_info() -> dict:
    """What this build and machine offer.

    Keys: ``simd`` (the SIMD level kernels use: scalar, avx2, avx512 or neon), ``simd_available``,
    ``cpu_features``, ``n_threads`` (the default thread pool's size), ``physical_cores``,
    ``cuda_compiled``, ``cuda_build`` (the build's OPTIML_CUDA setting: AUTO, ON, OFF or EMU),
    ``cuda_devices`` (a list of dicts: id, name, total_memory, free_memory, compute_capability,
    multiprocessors) and, when that list is empty, ``cuda_note`` saying why (for a build without the
    backend: whether it was turned off on purpose or nvcc was missing).
    """
    return _core.system_info()


def set_num_threads(n: int) -> None:
    """Sets the size of the default CPU thread pool (0 = the number of physical cores, at most 512)."""
    from .engine.checks import non_negative_int

    _core.set_num_threads(non_negative_int("the number of threads", n, _core.MAX_THREADS))


def get_num_threads() -> int:
    """The size of the default CPU thread pool."""
    return _core.get_num_threads()
