"""The real SmolLM2-135M-Instruct Q4_1 GGUF against llama.cpp's figures (shared/eval/REFERENCE.md), and
the Model API and CLI on it."""

import numpy as np
import pytest

import optiml
from optiml import cli

from conftest import shared_eval_text

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
GREEDY_32 = [7042, 30, 198, 198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33, 33, 2215, 701, 30, 198,
             198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33]
GREEDY_TEXT = (" Paris.\n\nThe United States has a population of approximately 311 million people.\n\n"
               "The United States has a population of approximately 31")
TOP5 = ["Paris", "the", "London", "New", "La"]  # llama.cpp's first-step top 5, in order


@pytest.fixture(scope="module")
def model(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=512, n_threads=2) as m:
        yield m


def test_prompt_ids_equal_llama_cpp(model):
    assert model.tokenize(PROMPT) == PROMPT_IDS  # SmolLM2 adds no BOS


def test_greedy_32_equal_llama_cpp(model):
    model.reset()
    logits = model.eval(PROMPT_IDS)
    out = []
    for _ in range(32):
        out.append(int(np.argmax(logits)))
        logits = model.eval([out[-1]])
    assert out == GREEDY_32
    assert model.detokenize(out) == GREEDY_TEXT


def test_generate_greedy_text_equals_llama_cpp(model):
    assert model.generate(PROMPT, max_tokens=32, temperature=0) == GREEDY_TEXT


def test_first_step_top5_equal_llama_cpp(model):
    model.reset()
    logits = model.eval(PROMPT_IDS)
    top = np.argsort(-logits)[:5]
    assert [model.detokenize([int(t)]).strip() for t in top] == TOP5
    # Values land near llama.cpp's (Paris 17.344, the 14.804): both quantize activations to 8 bits.
    assert abs(logits[top[0]] - 17.344) < 0.3 and abs(logits[top[1]] - 14.804) < 0.3


def test_perplexity_within_one_percent_of_llama_cpp(smollm2_path):
    text = shared_eval_text()
    with optiml.Model(smollm2_path, n_ctx=256, n_threads=2) as m:
        ppl, err, count = cli.perplexity(m, text, 256)
    assert abs(ppl - 24.72) / 24.72 < 0.01, ppl
    assert abs(err - 0.94) < 0.05
    assert count == 47 * 127


def test_stream_pieces_join_to_generate(model):
    pieces = list(model.stream(PROMPT, max_tokens=20, temperature=0.7, seed=42))
    assert len(pieces) > 1 and all(isinstance(p, str) and p for p in pieces)
    again = model.generate(PROMPT, max_tokens=20, temperature=0.7, seed=42)
    assert "".join(pieces) == again  # same seed, same text; the prompt prefix is reused from cache


def test_stop_strings_end_generation(model):
    text = model.generate(PROMPT, max_tokens=32, temperature=0, stop=["\n\n"])
    assert text == " Paris."
    text = model.generate(PROMPT, max_tokens=32, temperature=0, stop=["population", "xyz"])
    assert text == " Paris.\n\nThe United States has a "


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
            m.generate(PROMPT, top_p=0)
        with pytest.raises(optiml.ArgumentError):
            m.generate(PROMPT, max_tokens=-1)
        with pytest.raises(optiml.ArgumentError):
            m.generate(PROMPT, stop=[""])
    with pytest.raises(optiml.ArgumentError):
        optiml.Model(smollm2_path, n_ctx=0)
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


def test_cli_run_tokenize_info_bench(smollm2_path, capsys):
    assert cli.main(["run", "-m", str(smollm2_path), "-p", PROMPT, "-n", "32", "--temp", "0", "-t", "2"]) == 0
    assert capsys.readouterr().out == GREEDY_TEXT + "\n"
    assert cli.main(["tokenize", "-m", str(smollm2_path), "-p", PROMPT, "--ids"]) == 0
    assert capsys.readouterr().out.strip() == str(PROMPT_IDS)
    assert cli.main(["info", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "llama.block_count" in out and "272 tensors" in out and "n_layer=30" in out
    assert cli.main(["bench", "-m", str(smollm2_path), "-p", "16", "-n", "8", "-r", "1", "-t", "2"]) == 0
    out = capsys.readouterr().out
    assert "| pp16" in out and "| tg8" in out


def test_cli_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert cli.main(["run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"]) == 1
    assert "error: model file not found" in capsys.readouterr().err
