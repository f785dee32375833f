"""The one exception conversion raises for bad input (its own module so every part can import it)."""

from .._core import OptimlError


class ConvertError(OptimlError):
    """A Hugging Face checkpoint that cannot be converted: missing or malformed files, shapes that
    disagree with config.json, an unsupported architecture, dtype or tokenizer; or an output that
    cannot be written (a full disk). The message names the file and the problem."""
