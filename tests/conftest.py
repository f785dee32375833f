import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


def model_cache() -> Path:
    return Path(os.environ.get("OPTIML_MODEL_CACHE", Path.home() / ".cache" / "optiml" / "models"))


def model_path(name: str) -> Path:
    entry = json.loads((ROOT / "models" / "manifest.json").read_text())["models"][name]
    return model_cache() / entry["file"]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (fetched by tools/fetch_models.py; .ci/run does it)."""
    p = model_path("smollm2-135m-instruct-q4_1")
    if not p.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{p} is missing: .ci/run should have fetched it with tools/fetch_models.py")
        pytest.skip(f"{p} missing; run: python tools/fetch_models.py smollm2-135m-instruct-q4_1")
    return p
