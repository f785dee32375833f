"""The native output stage (optiml._core.OutputStage, native/src/generate/output.cpp): what becomes of one
sequence's row of logits in Model.generate's loop and in the server.

Oracles: numpy (argmax of the biased, masked row; float64 log-softmax for logprobs; a stable argsort for
the top logprobs, ties to the lower id), a twin Sampler with the same seed drawing from the row numpy
biased and masked, and the text the tokenizer decodes (stop strings cut where str.index finds them).
Only the SmolLM2 tokenizer is read (no weights): rows are made up.
"""

import numpy as np
import pytest

import optiml
from optiml.engine.generation import output_stage
from optiml.sampling import Sampler, SamplingParams
from optiml.tokenizer import Tokenizer

GREEDY = dict(temperature=0)
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_file(smollm2_path)


def sampler(tok, **params):
    return Sampler(tok.n_vocab, SamplingParams(**params))


def stage(tok, smp=None, stops=(), bias=None, top=-1):
    return output_stage(tok, smp or sampler(tok, **GREEDY), list(stops), bias, top)


def row(tok, seed=0):
    return np.random.default_rng(seed).normal(0, 3, tok.n_vocab).astype(np.float32)


def forced(tok, t):
    """A row whose argmax is token t."""
    r = np.zeros(tok.n_vocab, np.float32)
    r[t] = 10
    return r


def log_softmax(x):
    x = x.astype(np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def mask_bits(allowed):
    return np.packbits(allowed.astype(np.uint8), bitorder="little")


def test_logit_bias_moves_the_choice_and_the_logprobs(tok):
    x = row(tok)
    best = int(np.argmax(x))
    bias = {best: -100.0, 17: 4.5, 123: 2.0}
    b = x.copy()
    for t, v in bias.items():
        b[t] += np.float32(v)
    s = stage(tok, bias=bias, top=3)
    t, end, text, (lp, top) = s.step(x, None, False)
    assert t == int(np.argmax(b)) != best
    assert end is None and text == tok.decode([t])
    want = log_softmax(b)
    assert lp == pytest.approx(want[t], abs=1e-12)
    assert [u for u, _ in top] == list(np.argsort(-want, kind="stable")[:3])
    assert [v for _, v in top] == pytest.approx(want[[u for u, _ in top]], abs=1e-12)
    np.testing.assert_array_equal(x, row(tok))  # the caller's row is not changed


def test_the_mask_forbids_tokens(tok):
    x = row(tok, 1)
    allowed = np.random.default_rng(2).random(tok.n_vocab) < 0.01
    allowed[int(np.argmax(x))] = False
    s = stage(tok, top=5)
    t, _, _, (lp, top) = s.step(x, mask_bits(allowed), False)
    masked = np.where(allowed, x, -np.inf)
    assert t == int(np.argmax(masked)) and allowed[t]
    want = log_softmax(masked)
    assert lp == pytest.approx(want[t], abs=1e-12)
    assert [u for u, _ in top] == list(np.argsort(-want, kind="stable")[:5])
    # Sampled: every draw is allowed, and each is the twin sampler's draw from the masked row.
    smp, twin = sampler(tok, **SAMPLED), sampler(tok, **SAMPLED)
    s = stage(tok, smp)
    for i in range(50):
        x = row(tok, 100 + i)
        t = s.step(x, mask_bits(allowed), False)[0]
        assert allowed[t] and t == twin.sample(np.where(allowed, x, -np.inf))
        twin.accept(t)


def test_sampled_tokens_are_the_samplers_with_penalties(tok):
    params = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repeat_penalty=1.3, presence_penalty=0.5,
                  frequency_penalty=0.2, seed=77)
    smp, twin = sampler(tok, **params), sampler(tok, **params)
    prompt = [504, 2644, 2643]
    smp.accept(prompt)
    twin.accept(prompt)
    bias = {335: 3.0, 260: -2.0}
    s = stage(tok, smp, bias=bias)
    for i in range(40):
        x = row(tok, 200 + i) / 3  # flatter: the penalties and the filters matter
        b = x.copy()
        for t, v in bias.items():
            b[t] += np.float32(v)
        want = twin.sample(b)
        t = s.step(x, None, False)[0]
        if tok.is_eog(want):
            assert t == -1
            break
        assert t == want
        twin.accept(want)


def test_top_logprobs_break_ties_by_id_and_keep_forbidden_tokens_last(tok):
    x = np.zeros(tok.n_vocab, np.float32)
    x[[40, 7, 900, 5]] = [2.0, 2.0, 2.0, 1.0]
    allowed = np.zeros(tok.n_vocab, bool)
    allowed[[5, 7, 40, 900]] = True
    s = stage(tok, top=6)
    t, _, _, (lp, top) = s.step(x, mask_bits(allowed), False)
    assert t == 7  # greedy ties go to the lower id
    want = log_softmax(np.where(allowed, x, -np.inf))
    assert [u for u, _ in top] == [7, 40, 900, 5, 0, 1]
    assert [v for _, v in top[:4]] == pytest.approx(want[[7, 40, 900, 5]], abs=1e-12)
    assert top[4][1] == top[5][1] == -np.inf
    t, _, _, (lp, top) = stage(tok, top=0).step(x, None, False)
    assert top == [] and lp == pytest.approx(log_softmax(x)[7], abs=1e-12)
    assert stage(tok).step(x, None, False)[3] is None  # no logprobs asked


def feed(s, tok, ids, last_at=None):
    """Forces `ids` through the stage: [(token, end, text)] until it ends."""
    out = []
    for i, t in enumerate(ids):
        r = s.step(forced(tok, t), None, i == last_at)
        out.append(r[:3])
        if r[1] is not None:
            break
    return out


def test_a_stop_string_across_token_boundaries(tok):
    text = "The cat sat on the mat."
    ids = tok.encode(text, add_special=False)  # The| cat| sat| on| the| mat|.
    s = stage(tok, stops=["xyz", "t on"])
    out = feed(s, tok, ids)
    assert [e for _, e, _ in out] == [None, None, None, "stop"]  # ends at " on", which completes "t on"
    assert [p for _, _, p in out] == ["The", " ca", "t sa", ""]  # "t" waits each time: it may begin "t on"
    assert "".join(p for _, _, p in out) == text[: text.index("t on")]
    assert [t for t, _, _ in out] == ids[:4]  # the stop string's token is kept (completion_tokens count it)
    assert s.pending == ""


def test_held_text_goes_out_at_the_end_of_generation_or_the_last_token(tok):
    ids = tok.encode("The cat sat", add_special=False)
    s = stage(tok, stops=["t on"])
    feed(s, tok, ids)
    assert s.pending == "t"
    t, end, text, _ = s.step(forced(tok, tok.eog_ids[0]), None, False)
    assert (t, end, text) == (-1, "stop", "t")  # an end-of-generation token is not kept
    s = stage(tok, stops=["t on"])
    out = feed(s, tok, ids, last_at=len(ids) - 1)
    assert out[-1] == (ids[-1], "length", "t sat") and s.pending == ""  # the held "t" with the rest


def test_no_character_is_split(tok):
    ids = tok.encode("🦀 crab", add_special=False)  # the crab's four bytes in three tokens
    assert len(ids) == 4
    s = stage(tok)
    out = feed(s, tok, ids)
    assert [p for _, _, p in out] == ["", "", "🦀", " crab"]
    s = stage(tok)
    out = feed(s, tok, ids[:2], last_at=1)
    assert out[-1][1:] == ("length", "\ufffd")  # cut short: the unfinished character as U+FFFD


def test_bad_input_is_refused(tok):
    smp = sampler(tok, **GREEDY)
    with pytest.raises(optiml.ArgumentError, match="logit bias token"):
        stage(tok, smp, bias={tok.n_vocab: 1.0})
    with pytest.raises(optiml.ArgumentError, match="stop string 1 is empty"):
        stage(tok, smp, stops=["a", ""])
    with pytest.raises(optiml.ArgumentError, match="top_logprobs"):
        stage(tok, smp, top=-2)
    s = stage(tok, smp)
    with pytest.raises(optiml.ArgumentError, match="logits hold 10 values"):
        s.step(np.zeros(10, np.float32), None, False)
    with pytest.raises(optiml.ArgumentError, match="allowed-token mask holds 8 bits"):
        s.step(row(tok), np.ones(1, np.uint8), False)
    with pytest.raises(optiml.ArgumentError, match="every logit is -inf"):
        s.step(row(tok), np.zeros((tok.n_vocab + 7) // 8, np.uint8), False)
