"""response_format (json_object, json_schema) enforced while sampling, by llguidance.

llguidance builds its token trie from the model's vocabulary (each token's bytes; control tokens marked
with a leading 0xff as llguidance expects) and, for each step, gives a bitmask of the tokens that keep the
output inside the grammar. The native output stage (output.py) gives the tokens outside it -inf logits
before the sampler sees them.
"""

from __future__ import annotations

import json

import numpy as np

from .schemas import bad


class _VocabWrapper:
    """What llguidance.TokenizerWrapper reads from a tokenizer: token bytes, EOS/BOS, and encode()."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        n = tokenizer.n_vocab
        self.tokens = []
        self.special_token_ids = []
        for i in range(n):
            piece = tokenizer.token_to_piece(i, True)
            if tokenizer.is_control(i):
                piece = b"\xff" + piece
                self.special_token_ids.append(i)
            self.tokens.append(piece)
        eog = tokenizer.eog_ids
        self.eos_token_id = eog[0] if eog else tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None

    def __call__(self, text):
        return self.tokenizer.encode(text, add_special=False, parse_special=False)


class Grammars:
    """Compiles response formats for one tokenizer (built once, on first use: ~1 s for a 50k vocabulary).
    n_vocab: the model's logits per row (the tokenizer's vocabulary when None); ids past the tokenizer's
    are never allowed."""

    def __init__(self, tokenizer, n_vocab: int | None = None):
        self.tokenizer = tokenizer
        self.n_vocab = tokenizer.n_vocab if n_vocab is None else n_vocab
        self._ll = None

    def _lltokenizer(self):
        if self._ll is None:
            import llguidance

            w = llguidance.TokenizerWrapper(_VocabWrapper(self.tokenizer))
            self._ll = llguidance.LLTokenizer(w, n_vocab=self.tokenizer.n_vocab,
                                              eos_token=self.tokenizer.eog_ids or None)
        return self._ll

    def grammar(self, rf: dict) -> str:
        """The llguidance grammar of a checked response_format; a 400 for a schema it cannot compile."""
        import llguidance

        if rf["type"] == "json_object":
            schema = {"type": "object"}
        else:
            schema = rf["json_schema"].get("schema", {}) or {"type": "object"}
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise bad(f"response_format: {e}", "response_format") from None
        err = llguidance.LLMatcher.validate_grammar(g, self._lltokenizer())
        if err and not err.startswith("WARNING"):
            raise bad(f"response_format: the JSON schema cannot be enforced: {err}", "response_format")
        return g

    def matcher(self, grammar: str) -> "Constraint":
        import llguidance

        return Constraint(llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0), self.n_vocab)


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, matcher, n_vocab: int):
        self.m = matcher
        self.n_vocab = n_vocab

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows now: uint8 bits covering n_vocab tokens, token t at bit t % 8 of
        byte t // 8 (llguidance's 32-bit words, little-endian)."""
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        need = (self.n_vocab + 7) // 8
        if bits.size < need:
            bits = np.concatenate([bits, np.zeros(need - bits.size, np.uint8)])
        return bits

    def accept(self, tok: int) -> None:
        self.m.consume_token(int(tok))

    def done(self) -> bool:
        return self.m.is_stopped()

    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None
