"""The package's version (pyproject.toml says the same), apart so that any module may read it."""

__version__ = "0.1.0"
