"""The real SmolLM2-135M-Instruct Q4_1 GGUF against llama.cpp (llama-cpp-python, run live here) and
transformers float32 on its dequantized weights, and the Model API and CLI on it. No stored generated
tokens: at a near-tie the SIMD level picks the token (see fidelity.py)."""

import numpy as np
import pytest

import optiml
from optiml import cli

import fidelity
from conftest import shared_eval_text

PROMPT = "The capital of France is"
REFERENCE_MODEL = "smollm2_path"  # the path fixture conftest's llm and llama_greedy load
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # the tokenizer's answer (llama.cpp's too): no SIMD involved
N_CTX, N_WINDOWS = 256, 4  # the fidelity windows: 1024 tokens of shared/eval's text (512 were too few: their
# KLD moved 7% between our own SIMD levels, from a few tokens near a tie; ours/llama.cpp was 1.10 on AVX-512, 1.02 over 1024)


@pytest.fixture(scope="module")
def model(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=512, n_threads=2) as m:
        yield m




@pytest.fixture(scope="module")
def greedy(model):
    """Our 32 greedy tokens (argmax step by step) and their text: what generate/run/stop must reproduce."""
    model.reset()
    logits = model.eval(PROMPT_IDS)
    out = []
    for _ in range(32):
        out.append(int(np.argmax(logits)))
        logits = model.eval([out[-1]])
    model.reset()
    return out, model.detokenize(out)


def test_prompt_ids_equal_llama_cpp(model):
    assert model.tokenize(PROMPT) == PROMPT_IDS  # SmolLM2 adds no BOS


def test_greedy_agrees_with_llama_cpp_teacher_forced(model, llm, llama_greedy):
    theirs = llama_greedy[0]
    r = fidelity.teacher_forced_greedy(model, llm, PROMPT_IDS, theirs)
    assert r["disagree"] == [], r["disagree"]  # (step, ours, theirs, our top-2 gap, theirs)
    assert r["decided"] >= 24  # near-ties are rare: the check is not vacuous
    assert llm.detokenize(theirs).decode().startswith(" Paris.")


def test_generate_greedy_text_follows_llama_cpp(model, llm, greedy, llama_greedy):
    ours, text = greedy
    assert model.generate(PROMPT, max_tokens=32, temperature=0) == text
    ok, why = fidelity.first_divergence_is_a_near_tie(model, llm, PROMPT_IDS, ours, *llama_greedy)
    assert ok, why


def test_first_step_top5_near_llama_cpp(model, llm):
    model.reset()
    ours = model.eval(PROMPT_IDS)
    theirs = fidelity.llama_cpp_logits(llm, PROMPT_IDS)[-1]
    top = np.argsort(-theirs)[:5]
    assert int(np.argmax(ours)) == top[0] and model.detokenize([int(top[0])]) == " Paris"
    # Both quantize activations to 8 bits: the logits land close (llama.cpp's Paris 17.34, the 14.80, ...).
    assert np.abs(ours[top] - theirs[top]).max() < 0.3


@pytest.fixture(scope="module")
def kld(smollm2_path, model, llm):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    windows = fidelity.text_windows(model, shared_eval_text(), N_CTX, N_WINDOWS)
    return fidelity.kld_against_transformers(smollm2_path, model, llm, windows)


def test_kl_divergence_against_transformers_within_llama_cpp(kld):
    """llama.cpp's own KLD against transformers f32 on these tokens is the bar (0.0031 on the whole text,
    REFERENCE.md), as fidelity.assert_kld_within_llama_cpp says."""
    fidelity.assert_kld_within_llama_cpp(kld, N_CTX * N_WINDOWS, 0.006)


def test_perplexity_within_noise_of_llama_cpp(kld):
    """Perplexity of the windows' second halves (llama.cpp's convention), against llama.cpp's on the same
    tokens: within 1%, or within 3 standard errors of the paired per-token differences where these 256
    tokens are noisier than that (on a 2-core AVX2 Zen 3: 1.07% apart at a KLD equal to llama.cpp's). The
    whole-text figure (24.72 at ctx 256) is tools/bench/perplexity.py's."""
    fidelity.assert_ppl_within_noise(kld)


def test_stream_pieces_join_to_generate(model):
    pieces = list(model.stream(PROMPT, max_tokens=20, temperature=0.7, seed=42))
    assert len(pieces) > 1 and all(isinstance(p, str) and p for p in pieces)
    again = model.generate(PROMPT, max_tokens=20, temperature=0.7, seed=42)
    assert "".join(pieces) == again  # same seed, same text; the prompt prefix is reused from cache


def test_stop_strings_end_generation(model, greedy):
    full = greedy[1]
    assert "\n\n" in full  # " Paris.\n\n...": the first steps are far from any tie
    text = model.generate(PROMPT, max_tokens=32, temperature=0, stop=["\n\n"])
    assert text == full[: full.index("\n\n")]
    word = full[len(full) // 2 :].split()[0]  # a word from the middle of the greedy text
    text = model.generate(PROMPT, max_tokens=32, temperature=0, stop=[word, "xyz"])
    assert text == full[: full.index(word)]


def test_eos_ends_a_chat_turn(model):
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    out = model.generate(prompt, max_tokens=64, temperature=0)
    assert "4" in out and "<|im_end|>" not in out
    assert len(model.tokenize(out)) < 64


def test_eval_all_logits_and_context(model):
    model.reset()
    all_logits = model.eval(PROMPT_IDS, all_logits=True)
    assert all_logits.shape == (5, model.n_vocab)
    assert model.n_past == 5 and model.tokens == PROMPT_IDS
    model.reset()
    last = model.eval(PROMPT_IDS)
    np.testing.assert_array_equal(last, all_logits[-1])
    model.reset()
    assert model.n_past == 0


def test_context_overflow_and_bad_arguments(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=16) as m:
        with pytest.raises(optiml.ContextOverflowError, match="n_ctx=16"):
            m.eval(list(range(100, 120)))
        with pytest.raises(optiml.ContextOverflowError):
            m.generate("word " * 40)
        # Generation stops when the context is full instead of failing.
        out = m.generate(PROMPT, max_tokens=100, temperature=0)
        assert m.n_past == 16 and out.startswith(" Paris.")
        with pytest.raises(optiml.ArgumentError):
            m.eval([m.n_vocab])
        with pytest.raises(optiml.ArgumentError):
            m.eval([])
        with pytest.raises(optiml.ArgumentError):
            m.generate(PROMPT, top_p=-0.1)
        with pytest.raises(optiml.ArgumentError):
            m.generate(PROMPT, max_tokens=-1)
        with pytest.raises(optiml.ArgumentError):
            m.generate(PROMPT, stop=[""])
    with pytest.raises(optiml.ArgumentError):
        optiml.Model(smollm2_path, n_ctx=0)
    with pytest.raises(optiml.ArgumentError, match="more than this machine's .* GiB of memory"):  # (23 TiB)
        optiml.Model(smollm2_path, n_ctx=2**30)
    with pytest.raises(optiml.OptimlError, match="closed"):
        m.eval([1])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        optiml.Model(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 30)
    with pytest.raises(optiml.GGUFError):
        optiml.Model(bad)


def test_one_model_used_from_two_threads_is_refused(model):
    it = model.stream(PROMPT, max_tokens=5, temperature=0)
    next(it)  # the stream holds the model until it finishes
    with pytest.raises(optiml.OptimlError, match="in use"):
        model.eval([1])
    list(it)
    model.eval([1])  # free again


def test_cli_run_tokenize_info_bench(smollm2_path, greedy, capsys):
    assert cli.main(["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", "32", "--temp", "0", "-t", "2"]) == 0
    assert capsys.readouterr().out == greedy[1] + "\n"
    assert cli.main(["tokenize", "-m", str(smollm2_path), "-p", PROMPT, "--ids"]) == 0
    assert capsys.readouterr().out.strip() == str(PROMPT_IDS)
    assert cli.main(["info", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "llama.block_count" in out and "272 tensors" in out and "n_layer=30" in out
    assert cli.main(["bench", "-m", str(smollm2_path), "-p", "16", "-n", "8", "-r", "1", "-t", "2"]) == 0
    out = capsys.readouterr().out
    assert " pp16 | " in out and " tg8 | " in out


def test_cli_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert cli.main(["run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"]) == 2  # bad input
    assert "error: no such model file" in capsys.readouterr().err
