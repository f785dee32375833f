"""optiml system: the SIMD level, threads and CUDA devices of this build and machine."""

from __future__ import annotations

from .. import _core
from ..util import jsonout


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    print(jsonout.dumps(_core.system_info(), indent=2))
    return 0
