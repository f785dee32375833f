"""optiml.sampling against independent numpy (float64) references of each step of the chain."""

import math

import numpy as np
import pytest

import optiml
from optiml.sampling import RANDOM_SEED, Sampler, SamplingParams, find_stop, find_stop_ex

# Every filter off: the chain is penalties -> softmax(logits / T) over the whole vocabulary.
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


# ---- reference implementations (float64, written from the definitions in optiml/sampling.h) -----


def ref_penalties(logits, history, last_n=64, repeat=1.0, freq=0.0, pres=0.0):
    out = np.asarray(logits, np.float64).copy()
    window = list(history) if last_n < 0 else (list(history)[-last_n:] if last_n > 0 else [])
    for t in set(window):
        c = window.count(t)
        out[t] = out[t] / repeat if out[t] > 0 else out[t] * repeat
        out[t] -= c * freq + pres
    return out


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_dist(logits, history=(), temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
             repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0, seed=None):
    """(ids, probs) sorted by prob descending (ties: lower id first), as Sampler.probs defines them."""
    l = ref_penalties(logits, history, repeat_last_n, repeat_penalty, frequency_penalty, presence_penalty)
    ids = np.nonzero(l > -np.inf)[0]
    l = l[ids]
    order = np.lexsort((ids, -l))
    ids, l = ids[order], l[order]
    if temperature <= 0:
        return ids[:1], np.ones(1)
    if top_k > 0:
        ids, l = ids[:top_k], l[:top_k]
    if top_p < 1:
        n = int(np.argmax(np.cumsum(softmax(l)) >= top_p)) + 1 if np.cumsum(softmax(l))[-1] >= top_p else len(l)
        ids, l = ids[:n], l[:n]
    if min_p > 0:
        keep = l - l.max() >= math.log(min_p)
        ids, l = ids[keep], l[keep]
    return ids, softmax(l / temperature)


def assert_dist(sampler, logits, ref):
    ids, probs = sampler.probs(logits)
    rids, rprobs = ref
    assert ids.dtype == np.int32 and probs.dtype == np.float64
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(probs, rprobs, rtol=0, atol=1e-6)
    assert abs(probs.sum() - 1) < 1e-9


def random_logits(n, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# ---- an independent std::mt19937_64 (its output is fixed by the C++ standard) ---------------------

M64 = (1 << 64) - 1


class MT19937_64:
    def __init__(self, seed):
        self.mt = [seed & M64]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & M64)
        self.i = 312

    def __call__(self):
        if self.i >= 312:
            mt = self.mt
            for k in range(312):
                x = (mt[k] & 0xFFFFFFFF80000000) | (mt[(k + 1) % 312] & 0x7FFFFFFF)
                xa = (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
                mt[k] = mt[(k + 156) % 312] ^ xa
            self.i = 0
        y = self.mt[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & M64


def test_reference_mt19937_64_matches_the_standard():
    g = MT19937_64(5489)
    for _ in range(9999):
        g()
    assert g() == 9981545732273789042  # [rand.predef]: the 10000th output of a default mt19937_64


# ---- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    logits = random_logits(1000, 1)
    s = Sampler(1000, temperature=0.0)
    assert s.sample(logits) == int(np.argmax(logits))
    tied = np.zeros(50, np.float32)
    tied[[7, 3, 30]] = 2.5
    assert Sampler(50, temperature=0).sample(tied) == 3
    ids, probs = Sampler(50, temperature=0).probs(tied)
    assert ids.tolist() == [3] and probs.tolist() == [1.0]


def test_negative_temperature_is_greedy():
    logits = random_logits(300, 2)
    assert Sampler(300, temperature=-1.0, seed=5).sample(logits) == int(np.argmax(logits))


def test_greedy_applies_penalties():
    logits = np.array([1.0, 5.0, 4.0, -1.0], np.float32)
    s = Sampler(4, temperature=0, repeat_penalty=1.5)
    s.accept(1)  # 5 / 1.5 = 3.33 < 4
    assert s.sample(logits) == 2
    s = Sampler(4, temperature=0, presence_penalty=0.5, frequency_penalty=0.4)
    s.accept([2, 2, 2])  # 4 - 3*0.4 - 0.5 = 2.3 ; then token 1 wins anyway
    assert s.sample(logits) == 1
    s.accept([1])  # 5 - 0.4 - 0.5 = 4.1 > 2.3
    assert s.sample(logits) == 1
    s.accept([1, 1])  # 5 - 3*0.4 - 0.5 = 3.3 > 2.3 still
    assert s.sample(logits) == 1
    s.accept([1, 1, 1])  # 5 - 6*0.4 - 0.5 = 2.1 < 2.3
    assert s.sample(logits) == 2
    for seed in range(5):
        logits = random_logits(2000, 100 + seed)
        hist = np.random.default_rng(seed).integers(0, 2000, 300)
        s = Sampler(2000, temperature=0, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.3,
                    repeat_last_n=-1)
        s.accept(hist)
        assert s.sample(logits) == int(np.argmax(ref_penalties(logits, hist, -1, 1.3, 0.2, 0.3)))


# ---- distributions of each filter --------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        dict(PLAIN),
        dict(PLAIN, temperature=0.5),
        dict(PLAIN, temperature=2.5),
        dict(PLAIN, top_k=1),
        dict(PLAIN, top_k=10),
        dict(PLAIN, top_k=999),
        dict(PLAIN, top_k=5000),  # larger than the vocabulary: no-op
        dict(PLAIN, top_p=0.5),
        dict(PLAIN, top_p=0.9, temperature=0.7),
        dict(PLAIN, top_p=1e-6),  # only the best token
        dict(PLAIN, min_p=0.1),
        dict(PLAIN, min_p=0.01, temperature=1.7),
        dict(PLAIN, min_p=1.0),  # only the maximum
        dict(),  # llama.cpp defaults: top_k 40, top_p 0.95, min_p 0.05, T 0.8
        dict(top_k=100, top_p=0.8, min_p=0.02, temperature=1.3),
        dict(top_k=0, top_p=0.7, min_p=0.03, temperature=0.6),
    ],
)
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_distribution_matches_reference(params, scale):
    n = 1000
    for seed in range(3):
        logits = random_logits(n, seed, scale)
        assert_dist(Sampler(n, seed=1, **params), logits, ref_dist(logits, **params))


def test_top_p_without_top_k_on_a_large_vocabulary():
    # The incremental partial sort must sort as far as the cumulative probability needs, no further.
    n = 50_000
    for top_p in (0.3, 0.9, 0.999):
        logits = random_logits(n, 7, scale=2.0)
        params = dict(PLAIN, top_p=top_p)
        assert_dist(Sampler(n, **params), logits, ref_dist(logits, **params))


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    ids, _ = Sampler(4, **dict(PLAIN, top_p=0.6)).probs(logits)
    assert ids.tolist() == [0, 1]  # 0.5 < 0.6 <= 0.8
    ids, _ = Sampler(4, **dict(PLAIN, top_p=0.85)).probs(logits)
    assert ids.tolist() == [0, 1, 2]
    ids, _ = Sampler(4, **dict(PLAIN, top_p=0)).probs(logits)  # (OpenAI's and llama.cpp's: the likeliest alone)
    assert ids.tolist() == [0]


def test_top_p_and_min_p_see_temperature_one():
    # llama.cpp order: the filters run before the temperature, so T changes the shape, not the set.
    logits = random_logits(500, 3)
    sets = [set(Sampler(500, **dict(PLAIN, top_p=0.8, min_p=0.02, temperature=t)).probs(logits)[0])
            for t in (0.2, 1.0, 5.0)]
    assert sets[0] == sets[1] == sets[2]


def test_top_k_ties_break_by_id():
    logits = np.zeros(20, np.float32)
    logits[[4, 9, 15, 2]] = 1.0
    ids, probs = Sampler(20, **dict(PLAIN, top_k=3)).probs(logits)
    assert ids.tolist() == [2, 4, 9]
    np.testing.assert_allclose(probs, [1 / 3] * 3, atol=1e-7)


# ---- penalties -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pen",
    [
        dict(repeat_penalty=1.3),
        dict(repeat_penalty=0.7),  # < 1 encourages repeats
        dict(frequency_penalty=0.4),
        dict(presence_penalty=0.9),
        dict(frequency_penalty=-0.3, presence_penalty=-0.2),
        dict(repeat_penalty=1.2, frequency_penalty=0.25, presence_penalty=0.5),
    ],
)
@pytest.mark.parametrize("last_n", [64, 5, 1, -1, 0])
def test_penalties_match_reference(pen, last_n):
    n = 200
    logits = random_logits(n, 11, scale=2.0)
    logits[:10] = [3.0, -2.0, 0.0, 1.5, -0.5, 2.0, -3.0, 0.25, 4.0, -1.0]  # both signs, and zero
    hist = [0, 1, 2, 3, 1, 1, 4, 5, 6, 7, 8, 9, 0, 2, 2, 2, 8, 150, 8, 1]
    params = dict(PLAIN, repeat_last_n=last_n, **pen)
    s = Sampler(n, **params)
    s.accept(hist)
    expect_window = hist if last_n < 0 else (hist[-last_n:] if last_n > 0 else [])
    assert s.penalty_window == expect_window
    assert_dist(s, logits, ref_dist(logits, hist, **params))
    # The same through single accepts, and penalties combined with every filter.
    s2 = Sampler(n, **dict(params, top_k=30, top_p=0.9, min_p=0.01, temperature=0.7))
    for t in hist:
        s2.accept(t)
    assert_dist(s2, logits, ref_dist(logits, hist, **dict(params, top_k=30, top_p=0.9, min_p=0.01,
                                                             temperature=0.7)))


def test_penalty_window_slides():
    logits = np.array([2.0, 2.0, 2.0, 2.0], np.float32)
    s = Sampler(4, **dict(PLAIN, repeat_last_n=3, presence_penalty=1.0))
    for t in [0, 1, 2, 3, 3]:
        s.accept(t)
    assert s.penalty_window == [2, 3, 3]
    ids, probs = s.probs(logits)
    assert ids[0] == 0 and ids[1] == 1  # 0 and 1 have left the window
    assert_dist(s, logits, ref_dist(logits, [0, 1, 2, 3, 3], **dict(PLAIN, repeat_last_n=3, presence_penalty=1.0)))
    s.reset()
    assert s.penalty_window == []
    np.testing.assert_allclose(s.probs(logits)[1], [0.25] * 4, atol=1e-7)


def test_long_history_ring_wraps_many_times():
    n, last_n = 300, 17
    rng = np.random.default_rng(3)
    hist = rng.integers(0, 40, 1000)
    logits = random_logits(n, 4)
    params = dict(PLAIN, repeat_last_n=last_n, repeat_penalty=1.4, frequency_penalty=0.1)
    s = Sampler(n, **params)
    s.accept(hist)
    assert s.penalty_window == hist[-last_n:].tolist()
    assert_dist(s, logits, ref_dist(logits, hist, **params))


# ---- seeds and the draw --------------------------------------------------------------------------


def draw_sequence(sampler, logits_rows, accept=True):
    out = []
    for row in logits_rows:
        t = sampler.sample(row)
        if accept:
            sampler.accept(t)
        out.append(t)
    return out


def test_same_seed_same_sequence_different_seed_different():
    rows = [random_logits(5000, i, scale=1.5) for i in range(200)]
    params = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.0, repeat_penalty=1.1, seed=1234)
    a = draw_sequence(Sampler(5000, **params), rows)
    b = draw_sequence(Sampler(5000, **params), rows)
    c = draw_sequence(Sampler(5000, **dict(params, seed=1235)), rows)
    assert a == b
    assert a != c
    s = Sampler(5000, **params)
    draw_sequence(s, rows[:50])
    s.reset()  # clears history and re-seeds: replays the sequence
    assert draw_sequence(s, rows) == a


def test_random_seed():
    rows = [random_logits(5000, i, scale=0.5) for i in range(50)]
    s1, s2 = Sampler(5000, temperature=1.0), Sampler(5000, seed=RANDOM_SEED, temperature=1.0)
    assert s1.params.seed == RANDOM_SEED == 0xFFFFFFFF
    assert s1.seed != s2.seed  # 2**-64 chance of a false failure
    a, b = draw_sequence(s1, rows), draw_sequence(s2, rows)
    assert a != b
    # The drawn seed reproduces the run.
    assert draw_sequence(Sampler(5000, temperature=1.0, seed=s1.seed), rows) == a
    old = s1.seed
    s1.reset()
    assert s1.seed != old


def test_draw_is_exactly_specified():
    """Draw = first token (in id order when no filter reorders) whose cumulative weight exceeds
    u * total, u = (mt19937_64() >> 11) / 2**53. Pinned here so that draws are the same everywhere."""
    n = 64
    logits = random_logits(n, 9, scale=1.0)
    logits[5] = -np.inf
    for seed in (0, 42, 2**63 + 5):
        s = Sampler(n, **dict(PLAIN, temperature=0.9, seed=seed))
        g = MT19937_64(seed)
        w = np.exp((logits.astype(np.float64) - logits.max()) / 0.9)
        cum = np.cumsum(w)
        for _ in range(300):
            u = (g() >> 11) / 2.0**53
            assert s.sample(logits) == int(np.searchsorted(cum, u * cum[-1], side="right"))


def test_empirical_frequencies_match_target():
    n = 12
    logits = np.array([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0, 1.9, -np.inf], np.float32)
    for params in (dict(PLAIN), dict(top_k=6, top_p=0.95, min_p=0.05, temperature=0.8),
                   dict(PLAIN, temperature=1.6, min_p=0.03)):
        s = Sampler(n, seed=777, **params)
        rids, rprobs = ref_dist(logits, **params)
        draws = np.array([s.sample(logits) for _ in range(20_000)])
        counts = np.bincount(draws, minlength=n)
        assert counts[np.setdiff1d(np.arange(n), rids)].sum() == 0  # filtered and -inf tokens never drawn
        expected = rprobs * len(draws)
        chi2 = float(((counts[rids] - expected) ** 2 / expected).sum())
        # df <= 10: P(chi2 > 35) < 1e-4 for a correct sampler (and the seed is fixed anyway).
        assert chi2 < 35, (params, chi2)


def test_sample_does_not_record():
    logits = random_logits(100, 5)
    s = Sampler(100, repeat_penalty=1.5, seed=3)
    s.sample(logits)
    assert s.penalty_window == []


def test_single_survivor_needs_no_randomness():
    logits = random_logits(100, 6)
    s = Sampler(100, top_k=1, temperature=1.0, seed=1)
    assert all(s.sample(logits) == int(np.argmax(logits)) for _ in range(20))


# ---- non-finite logits ------------------------------------------------------------------------------


def test_neg_inf_is_never_chosen():
    n = 1000
    logits = np.full(n, -np.inf, np.float32)
    logits[[10, 500, 999]] = [0.0, 0.1, -0.1]
    s = Sampler(n, **dict(PLAIN, seed=4))
    assert set(s.sample(logits) for _ in range(500)) == {10, 500, 999}
    ids, _ = s.probs(logits)
    assert sorted(ids.tolist()) == [10, 500, 999]
    # Penalties leave -inf at -inf.
    s = Sampler(n, **dict(PLAIN, repeat_penalty=2.0, presence_penalty=-5.0))
    s.accept([0, 1, 2])
    assert sorted(s.probs(logits)[0].tolist()) == [10, 500, 999]
    assert Sampler(n, temperature=0).sample(logits) == 500


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_pos_inf_raise(bad):
    logits = random_logits(50, 8)
    logits[17] = bad
    for params in (dict(), dict(temperature=0)):
        s = Sampler(50, **params)
        with pytest.raises(optiml.ArgumentError, match="token 17"):
            s.sample(logits)
        with pytest.raises(ValueError):  # ArgumentError is a ValueError too
            s.probs(logits)
        # The sampler is still usable afterwards.
        logits2 = logits.copy()
        logits2[17] = 0.0
        s.sample(logits2)


def test_all_neg_inf_raises():
    for params in (dict(), dict(temperature=0)):
        with pytest.raises(optiml.ArgumentError, match="-inf"):
            Sampler(8, **params).sample(np.full(8, -np.inf, np.float32))


def test_greedy_fast_path_is_numpy_argmax():
    # Greedy without penalties skips the candidate list: the first maximum in id order, -inf ignored,
    # NaN or +inf anywhere (first place included) still named.
    rng = np.random.default_rng(11)
    for trial in range(200):
        n = int(rng.integers(1, 3000))
        logits = rng.integers(-3, 4, n).astype(np.float32)  # many ties
        logits[rng.random(n) < 0.2] = -np.inf
        if np.all(logits == -np.inf):
            logits[0] = 0.0
        assert Sampler(n, temperature=0).sample(logits) == int(np.argmax(logits))
    for at in (0, 5, 9):
        for bad in (np.nan, np.inf):
            logits = np.zeros(10, np.float32)
            logits[at] = bad
            with pytest.raises(optiml.ArgumentError, match=f"token {at}"):
                Sampler(10, temperature=0).sample(logits)


# ---- parameter validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_vocab,params,match",
    [
        (0, {}, "n_vocab"),
        (-3, {}, "n_vocab"),
        (10, dict(top_p=-0.5), "top_p"),
        (10, dict(top_p=float("nan")), "top_p"),
        (10, dict(min_p=1.5), "min_p"),
        (10, dict(min_p=float("nan")), "min_p"),
        (10, dict(temperature=float("nan")), "temperature"),
        (10, dict(temperature=float("inf")), "temperature"),
        (10, dict(repeat_penalty=0.0), "repeat_penalty"),
        (10, dict(repeat_penalty=-1.0), "repeat_penalty"),
        (10, dict(repeat_last_n=-2), "repeat_last_n"),
        (10, dict(frequency_penalty=float("inf")), "frequency_penalty"),
        (10, dict(presence_penalty=float("nan")), "presence_penalty"),
        (10, dict(seed=-1), "seed"),
        (10, dict(top_k=1.5), "top_k"),
        (10, dict(topk=3), "unknown"),
    ],
)
def test_bad_parameters(n_vocab, params, match):
    with pytest.raises(optiml.ArgumentError, match=match):
        Sampler(n_vocab, **params)


def test_edge_parameters_are_accepted():
    logits = random_logits(10, 0)
    for params in (dict(top_p=1.0), dict(top_p=3.0), dict(min_p=-1.0), dict(min_p=1.0), dict(top_k=-7),
                   dict(repeat_last_n=-1), dict(repeat_last_n=0), dict(seed=0), dict(seed=2**64 - 1)):
        Sampler(10, **params).sample(logits)
    p = SamplingParams(temperature=0.3, top_k=5)
    s = Sampler(10, p, seed=9)
    assert s.params.temperature == 0.3 and s.params.top_k == 5 and s.seed == 9


def test_bad_calls():
    s = Sampler(10)
    with pytest.raises(optiml.ArgumentError, match="10"):
        s.sample(np.zeros(11, np.float32))
    with pytest.raises(optiml.ArgumentError):
        s.probs(np.zeros(9, np.float32))
    with pytest.raises(optiml.ArgumentError, match="1-D"):
        s.sample(np.zeros((1, 10), np.float32))
    for tok in (-1, 10, [1, 2, 10], np.array([3, -4])):
        with pytest.raises(optiml.ArgumentError, match="out of range"):
            s.accept(tok)
    with pytest.raises(optiml.ArgumentError):
        s.accept([1.5])
    # float64 and non-contiguous rows are converted.
    row = np.zeros(20, np.float64)
    row[6] = 9.0
    assert Sampler(10, temperature=0).sample(row[::2]) == 3


# ---- stop strings ------------------------------------------------------------------------------------


def test_earliest_stop_wins():
    text = "answer: 42\nUser: next END"
    assert find_stop_ex(text, ["END", "\nUser:"]) == (10, 1, 0)
    assert find_stop(text, ["END", "\nUser:"]) == (10, 0)
    assert find_stop_ex("zabcd", ["abc", "ab"]) == (1, 0, 0)  # same start: the first listed
    assert find_stop_ex("zabcd", ["bcd", "abc"]) == (1, 1, 0)
    assert find_stop("nothing here", ["END"]) == (-1, 0)
    assert find_stop("", ["END"]) == (-1, 0)
    assert find_stop("END", []) == (-1, 0)
    assert find_stop("xENDyEND", "END") == (1, 0)  # a single stop string


def test_hold_back_partial_stop():
    assert find_stop("hello <|e", ["<|end|>"]) == (-1, 3)
    assert find_stop("hello <", ["<|end|>"]) == (-1, 1)
    assert find_stop("hello <|x", ["<|end|>"]) == (-1, 0)
    assert find_stop("say Us", ["<|end|>", "User:"]) == (-1, 2)  # the longest partial across stops
    assert find_stop("xaa", ["aab"]) == (-1, 2)
    assert find_stop("aaa", ["aab"]) == (-1, 2)
    assert find_stop("a", ["abc"]) == (-1, 1)
    assert find_stop("ab", ["ab"]) == (0, 0)  # a full match is a match, not a hold


def test_start_offset():
    assert find_stop("ENDxEND", ["END"], start=1) == (4, 0)
    assert find_stop("ENDxEN", ["END"], start=1) == (-1, 2)
    with pytest.raises(optiml.ArgumentError):
        find_stop("abc", ["b"], start=4)


def test_stop_utf8_bytes_and_characters():
    # str: units are characters; bytes: units are bytes.
    assert find_stop("café", ["é!"]) == (-1, 1)
    assert find_stop("café".encode(), ["é!".encode()]) == (-1, 2)
    assert find_stop("naïve ✓ done", ["✓"]) == (6, 0)
    assert find_stop("naïve ✓ done".encode(), ["✓".encode()]) == (7, 0)
    # Bytes ending inside a character are held back even without any stop prefix.
    euro = "€".encode()  # e2 82 ac
    assert find_stop(b"ab" + euro[:1], [b"zz"]) == (-1, 1)
    assert find_stop(b"ab" + euro[:2], [b"zz"]) == (-1, 2)
    assert find_stop(b"ab" + euro, [b"zz"]) == (-1, 0)
    emoji = "🙂".encode()  # 4 bytes
    assert find_stop(b"x" + emoji[:3], [b"zz"]) == (-1, 3)
    # A stop whose bytes start in the middle of a character never cuts that character in two.
    assert find_stop(euro[:2], [euro[1:] + b"!"]) == (-1, 2)
    # Invalid bytes are not held forever.
    assert find_stop(b"ab\x80\x80\x80\x80", [b"zz"]) == (-1, 0)


def test_stop_bad_arguments():
    with pytest.raises(optiml.ArgumentError, match="empty"):
        find_stop("abc", ["x", ""])
    with pytest.raises(optiml.ArgumentError):
        find_stop("abc", [b"b"])
    with pytest.raises(optiml.ArgumentError):
        find_stop(b"abc", ["b"])
    with pytest.raises(optiml.ArgumentError):
        find_stop(3, ["b"])


@pytest.mark.parametrize("chunk_seed", range(20))
def test_streaming_simulation(chunk_seed):
    """Emit text as bytes arrive in random chunks: the output must be exactly the text before the first
    stop, every emitted prefix must be valid UTF-8, and nothing emitted can later turn out to be a stop."""
    full = "Héllo wörld — STOne, 🙂 <|en… ünïcode <|end|> after".encode()
    stops = ["<|end|>".encode(), "🙂!".encode(), "STOP".encode()]
    cut = full.find(b"<|end|>")
    rng = np.random.default_rng(chunk_seed)
    emitted, end = b"", 0
    while True:
        end = min(len(full), end + int(rng.integers(1, 5)))
        text = full[:end]
        pos, hold = find_stop(text, stops, start=len(emitted))
        if pos >= 0:
            emitted += text[len(emitted):pos]
            break
        safe = len(text) - hold
        assert safe >= len(emitted)
        emitted += text[len(emitted):safe]
        emitted.decode("utf-8")  # never half a character
        assert full[:cut].startswith(emitted)
        assert end < len(full)
    assert emitted == full[:cut]


def test_min_p_and_top_p_together():
    # Both keep a best-first prefix; whichever is shorter decides (top-p's mass is before min-p).
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05])).astype(np.float32)
    for top_p, min_p, expect in ((0.6, 0.1, [0, 1]), (0.95, 0.45, [0, 1, 2]), (0.95, 0.1, [0, 1, 2, 3]),
                                 (0.65, 0.6, [0, 1])):
        params = dict(PLAIN, top_p=top_p, min_p=min_p)
        ids, _ = Sampler(5, **params).probs(logits)
        assert ids.tolist() == expect, (top_p, min_p)
        assert_dist(Sampler(5, **params), logits, ref_dist(logits, **params))


def test_tiny_temperature_is_greedy_not_nan():
    logits = random_logits(100, 13)
    for t in (1e-45, 1e-30, 1e-6):
        s = Sampler(100, **dict(PLAIN, temperature=t, seed=2))
        assert all(s.sample(logits) == int(np.argmax(logits)) for _ in range(10))
        ids, probs = s.probs(logits)
        assert ids[0] == int(np.argmax(logits)) and abs(probs[0] - 1) < 1e-12
