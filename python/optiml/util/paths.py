"""Where OptiML keeps its own files (the model cache, the chat history): $OPTIML_HOME, else ~/.cache/optiml."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["optiml_home"]


def optiml_home() -> Path:
    """$OPTIML_HOME (read now, so a test or a caller may set it), else ~/.cache/optiml."""
    home = os.environ.get("OPTIML_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "optiml"
