"""optiml system: the SIMD level, threads and CUDA devices of this build and machine."""

from __future__ import annotations

import json

from .. import _core


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    print(json.dumps(_core.system_info(), indent=2))
    return 0
