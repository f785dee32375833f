"""The native generation loop (optiml._core.Generator behind Model.stream/generate/chat) on SmolLM2.

The oracle is the Python loop Model.stream ran before the loop went native, written here with the
public pieces it used (Model.eval, Sampler, Detokenizer, find_stop): same seed, same pieces and tokens."""

import gc
import os
import threading

import numpy as np
import pytest

import optiml
from optiml import _core
from optiml.sampling import Sampler, SamplingParams, find_stop

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=512, n_threads=2) as m:
        yield m


def python_loop(m, prompt, max_tokens, stops=(), **sampling):
    """The former Python loop, from an empty context: (pieces, the context's ids afterwards, sampled ids)."""
    m.reset()
    ids = list(prompt) if isinstance(prompt, list) else m.tokenize(prompt, special=True)
    sampler = Sampler(m.n_vocab, SamplingParams(**sampling))
    logits = m.eval(ids)
    sampler.accept(ids)
    detok = m.tokenizer.detokenizer()
    pieces, sampled, pending = [], [], ""
    for i in range(max_tokens):
        tok = sampler.sample(logits)
        if m.tokenizer.is_eog(tok):
            break
        sampler.accept(tok)
        sampled.append(tok)
        pending += detok.push(tok)
        if stops:
            at, hold = find_stop(pending, list(stops))
            if at >= 0:
                if at:
                    pieces.append(pending[:at])
                return pieces, m.tokens, sampled
            out, pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        else:
            out, pending = pending, ""
        if out:
            pieces.append(out)
        if i + 1 == max_tokens or m.n_past >= m.n_ctx:
            break
        logits = m.eval([tok])
    pending += detok.flush()
    if pending:
        pieces.append(pending)
    return pieces, m.tokens, sampled


CASES = [
    dict(prompt=PROMPT, max_tokens=40, temperature=0),
    dict(prompt=PROMPT, max_tokens=48, temperature=0.9, seed=7, repeat_penalty=1.3, frequency_penalty=0.2,
         presence_penalty=0.1),
    dict(prompt="Once upon a time", max_tokens=64, temperature=1.2, top_k=0, top_p=0.9, min_p=0.0, seed=123,
         stops=(" the ", "\n\n")),
    dict(prompt="Once upon a time", max_tokens=64, temperature=0.7, seed=2**40 + 5, stops=("xyzzy", "ing")),
    dict(prompt=CHAT, max_tokens=64, temperature=0),  # ends on <|im_end|>
    dict(prompt=CHAT, max_tokens=64, temperature=0.8, seed=3, stops=("<|im_end|>",)),
    dict(prompt=PROMPT, max_tokens=0, temperature=0),
    dict(prompt=PROMPT, max_tokens=1, temperature=0.8, seed=11),
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_native_loop_equals_the_python_loop(model, case):
    case = dict(case)
    prompt, max_tokens, stops = case.pop("prompt"), case.pop("max_tokens"), case.pop("stops", ())
    want_pieces, want_ctx, want_sampled = python_loop(model, prompt, max_tokens, stops, **case)
    model.reset()
    pieces = list(model.stream(prompt, max_tokens=max_tokens, stop=list(stops) or None, **case))
    assert pieces == want_pieces
    assert all(isinstance(p, str) and p for p in pieces)
    assert model.tokens == want_ctx and model.n_past == len(want_ctx)
    st = model.last_stats
    n_prompt = len(model.tokenize(prompt, special=True))
    assert st["prompt_tokens"] == st["prompt_evaluated"] == n_prompt
    assert st["gen_tokens"] == len(want_sampled)
    assert st["busy_s"] >= 0


def test_context_full_equals_the_python_loop(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=16, n_threads=2) as m:
        want_pieces, want_ctx, _ = python_loop(m, PROMPT, 100, temperature=0.8, seed=5)
        m.reset()
        assert list(m.stream(PROMPT, max_tokens=100, temperature=0.8, seed=5)) == want_pieces
        assert m.tokens == want_ctx and m.n_past == 16


def test_chat_equals_the_python_loop(model):
    model.reset()
    msgs = [{"role": "user", "content": "Name three colours."}]
    answer = model.chat(msgs, temperature=0.8, seed=4, max_tokens=40)
    ids = model.chat_prompt(msgs)
    assert ids == model.tokens[: len(ids)]
    pieces, _, _ = python_loop(model, ids, 40, model.chat_template.stop, temperature=0.8, seed=4)
    assert answer == "".join(pieces)


@pytest.mark.parametrize("how", ["close", "del"])
def test_abandoned_stream_leaves_the_context_right(model, how):
    _, _, sampled = python_loop(model, PROMPT, 30, temperature=0)
    model.reset()
    it = model.stream(PROMPT, max_tokens=30, temperature=0)
    got = [next(it) for _ in range(3)]  # three tokens of plain English: three pieces
    assert "".join(got) == model.detokenize(sampled[:3])
    if how == "close":
        it.close()
    else:
        del it
        gc.collect()
    # The third token was sampled but never run: the context holds the prompt and two tokens.
    assert model.tokens == PROMPT_IDS + sampled[:2] and model.n_past == 7
    model.eval([sampled[2]])  # the model is free again
    assert model.n_past == 8
    # The next generation reuses the cached prompt and continues exactly as a fresh one.
    assert model.generate(PROMPT, max_tokens=30, temperature=0) == model.detokenize(sampled)
    assert model.last_stats["prompt_evaluated"] == 1


def test_closing_the_model_mid_stream(smollm2_path):
    m = optiml.Model(smollm2_path, n_ctx=64, n_threads=2)
    it = m.stream(PROMPT, max_tokens=10, temperature=0)
    first = next(it)
    m.close()
    rest = "".join(it)  # the stream keeps its context alive and finishes
    assert (first + rest).startswith(" Paris.")
    with pytest.raises(optiml.OptimlError, match="closed"):
        m.generate(PROMPT)


def test_ctrl_c_stops_generate(smollm2_path):
    """Ctrl-C during generate() (which drains the stream in C: "".join) raises KeyboardInterrupt at the next
    token, and the context holds what ran, instead of waiting for the whole answer."""
    import subprocess
    import sys

    code = (
        "import optiml, os, signal, threading, sys\n"
        f"m = optiml.Model({str(smollm2_path)!r}, n_ctx=4096, n_threads=1)\n"
        "m.generate('Hi', max_tokens=1)\n"  # (warm: the first step repacks)
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "try:\n"
        "    m.generate('1, 2, 3, 4, 5, 6,', max_tokens=3000, temperature=0)\n"  # (counts on: no early end)
        "    print('finished', m.n_past)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', m.n_past, len(m.tokens))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    said, n_past, n_tokens = r.stdout.split()
    assert said == "interrupted" and 5 < int(n_past) < 2000 and int(n_tokens) == int(n_past), r.stdout


def test_ctrl_c_stops_a_long_prompt(smollm2_path):
    """Ctrl-C while a long prompt runs (eval, or generate's first step) stops after the n_batch-token piece
    that is running, not after the whole prompt; the context keeps the pieces that ran, and what the Model
    believes it holds is what it holds (a stale belief made the next generate reuse text that was not there)."""
    import subprocess
    import sys

    code = (
        "import optiml, os, signal, threading, time\n"
        f"m = optiml.Model({str(smollm2_path)!r}, n_ctx=4096, n_threads=1, n_batch=8)\n"
        "ids = m.tokenize('the quick brown fox jumps ' * 800)[:4000]\n"
        "want = m.generate('The capital of France is', max_tokens=8, temperature=0)\n"
        "def ctrl_c_once_running(n0):\n"
        "    while m.n_past <= n0: time.sleep(0.001)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "for how in ('eval', 'generate'):\n"
        "    m.reset(); m.eval(ids[:3])\n"
        "    threading.Thread(target=ctrl_c_once_running, args=(3,)).start()\n"
        "    try:\n"
        "        m.eval(ids) if how == 'eval' else m.generate(ids[:3] + ids, max_tokens=1)\n"
        "        print(how, 'finished')\n"
        "    except KeyboardInterrupt:\n"
        "        n = m.n_past\n"
        "        print(how, 'interrupted', n, (n - 3) % 8 == 0, m.tokens == ids[:3] + ids[:n - 3],\n"
        "              m.generate('The capital of France is', max_tokens=8, temperature=0) == want)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        assert line.split()[1] == "interrupted", line  # (not "finished": Ctrl-C did not stop the prompt)
        how, said, n_past, whole_pieces, known, same = line.split()
        assert int(n_past) < 3000, line
        assert whole_pieces == known == same == "True", line


def test_eval_after_a_batch_on_sequence_0_is_not_taken_for_the_prompt(smollm2_path):
    """eval appends after what a batch put in sequence 0; the tokens it ran sit after those, so a prompt
    that starts with them must not reuse them as its own first positions."""
    with optiml.Model(smollm2_path, n_ctx=128, n_threads=1) as m:
        want = m.generate(PROMPT, max_tokens=8, temperature=0)
        m.reset()
        m.decode(optiml.Batch().add_sequence(m.tokenize("Once upon a time there"), seq=0, logits="none"))
        ids = m.tokenize(PROMPT)
        m.eval(ids[:3])
        assert m.generate(ids, max_tokens=8, temperature=0) == want


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_fork_while_another_thread_generates(smollm2_path):
    """A process forked while another thread runs a model (its thread pool mid-job, its lock held by a
    thread the child does not have) can load and run models in the child: the pools made before the fork
    run inline there, and the default pool is made anew (the child used to spin forever on it)."""
    import subprocess
    import sys

    code = (
        "import optiml, os, signal, sys, threading, time, warnings\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"  # (Python 3.12's note on fork with threads)
        f"M = {str(smollm2_path)!r}\n"
        "for n_threads in (0, 2):\n"
        "    m = optiml.Model(M, n_threads=n_threads, n_ctx=512)\n"
        "    stop = False\n"
        "    def loop():\n"
        "        while not stop:\n"
        "            m.generate('Once upon a time', max_tokens=16, temperature=0)\n"
        "    t = threading.Thread(target=loop); t.start(); time.sleep(0.3)\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        signal.alarm(120)\n"
        "        c = optiml.Model(M, n_threads=n_threads, n_ctx=128)\n"
        "        sys.stdout.write(repr(c.generate('The capital of France is', max_tokens=4, temperature=0)) + '\\n')\n"
        "        sys.stdout.flush(); os._exit(0)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    stop = True; t.join()\n"
        "    print(n_threads, os.waitstatus_to_exitcode(status),\n"
        "          repr(m.generate('The capital of France is', max_tokens=4, temperature=0)), flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OPTIML_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    for child, parent in (lines[0:2], lines[2:4]):  # the child's answer, then the parent's line
        n_threads, status, want = parent.split(" ", 2)
        assert status == "0" and child == want, (child, parent)


def test_closed_model_says_so(smollm2_path):
    m = optiml.Model(os.fsencode(smollm2_path), n_ctx=64)  # (a path as bytes, as os.fsencode gives)
    m.close()
    for use in (lambda: m.n_past, lambda: m.eval([1]), lambda: m.plan, lambda: m.chat([{"role": "user", "content": "Hi"}]),
                lambda: m.tokenize("Hello"), lambda: m.detokenize([19556]),
                lambda: m.chat_prompt([{"role": "user", "content": "Hi"}])):
        with pytest.raises(optiml.OptimlError, match="closed"):
            use()
    assert "closed" in repr(m)


@pytest.mark.parametrize("call,said", [
    (lambda m: m.chat([{"content": "hi"}]), r"messages\[0\]\['role'\]"),
    (lambda m: m.chat([{"role": "user", "content": 5}]), r"messages\[0\]\['content'\]"),
    (lambda m: m.chat([{"role": "user"}]), r"messages\[0\] has no 'content'"),
    (lambda m: m.chat("hello"), "must be a list"),
    (lambda m: m.chat(["hello"]), r"messages\[0\] must be a dict"),
    (lambda m: m.chat(None), "must be a list"),
    (lambda m: m.chat([]), "messages is empty"),
    (lambda m: m.generate(PROMPT, temperature="0"), "temperature must be a number"),
    (lambda m: m.generate(PROMPT, top_p=None), "top_p must be a number"),
    (lambda m: m.generate(PROMPT, max_tokens=2**40), "at most"),
    (lambda m: m.tokenize(None), "str or bytes"),
    (lambda m: m.generate([19556.9, 905.5]), "token ids must be integers"),  # (not run as 19556, 905)
    (lambda m: m.generate([True, 905]), "token ids must be integers"),
    (lambda m: m.generate([905, 10**9]), "outside the vocabulary"),
    (lambda m: m.generate(None), "text .str or bytes. or a sequence of token ids"),
    (lambda m: m.generate(PROMPT, stop=5), "stop must be a string or a list"),
    (lambda m: m.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "only text parts"),
])
def test_bad_arguments_are_argument_errors(model, call, said):
    """Caller mistakes are ArgumentErrors that name the argument: not the chat template's failure, not a
    nanobind signature dump, not a TypeError from deep inside."""
    with pytest.raises(optiml.ArgumentError, match=said):
        call(model)


def test_max_tokens_none_is_no_limit(smollm2_path):
    """max_tokens=None generates until the end of generation or a full context, as chat() and
    llama-cpp-python take it."""
    with optiml.Model(smollm2_path, n_ctx=48, n_threads=2) as m:
        want = m.generate("1, 2, 3,", max_tokens=48, temperature=0)
        assert m.generate("1, 2, 3,", max_tokens=None, temperature=0) == want and m.n_past == m.n_ctx


def test_message_content_as_the_server_takes_it(model):
    """OpenAI's text parts are their text, and a None content is empty, as optiml serve takes them (the
    model's template, which concatenates strings, failed on them and the error blamed the model file); a
    template the caller set that fails says to fix that template, not the model file."""
    text = [{"role": "user", "content": "Name a color."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]
    assert model.chat_prompt(parts) == model.chat_prompt(text)
    assert model.chat_prompt([{"role": "system", "content": None}] + text) == \
        model.chat_prompt([{"role": "system", "content": ""}] + text)
    try:
        model.chat_template = "{{ messages[0]['content'] + 1 }}"
        with pytest.raises(optiml.ChatTemplateError, match="fix the template given to Model.chat_template") as e:
            model.chat_prompt(text)
        assert "broken or hostile" not in str(e.value)
    finally:
        model.chat_template = None


def test_a_bytes_prompt_is_text(model):
    """A bytes prompt to generate is tokenized as text, as tokenize takes it (it was taken as token ids, one
    per byte); the context then holds the prompt and the generated tokens but the last, as documented."""
    out = model.generate(PROMPT.encode(), max_tokens=4, temperature=0)
    assert out == model.generate(PROMPT, max_tokens=4, temperature=0)
    held = model.tokens
    assert held[:len(PROMPT_IDS)] == PROMPT_IDS and len(held) == len(PROMPT_IDS) + 3 == model.n_past
    assert (PROMPT + out).startswith(model.detokenize(held))


def test_messages_as_templates_take_them(model):
    """What transformers' apply_chat_template takes is still taken: an iterable of messages, content as a list
    of parts (for templates that read them), None or left out with tool_calls (an assistant's tool call)."""
    from optiml.engine.chat_template import ChatTemplate

    msgs = [{"role": "user", "content": "Hi"}]
    assert model.chat_template.render(iter(msgs)) == model.chat_template.render(msgs)
    parts = ChatTemplate("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
                         "{% elif m.content %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %};{% endfor %}")
    assert parts.render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                         {"role": "assistant", "content": None}], add_generation_prompt=False) == "user:Hi;assistant:;"
    # an assistant's tool call written without content, as transformers' tool-use examples write it
    assert parts.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"type": "function"}]}],
                        add_generation_prompt=False) == "user:Hi;assistant:;"


def test_unknown_settings_are_named(model):
    with pytest.raises(TypeError, match="generate.* unexpected keyword argument 'foo'"):
        model.generate(PROMPT, foo=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'; the sampling settings are .*temperature"):
        model.chat([{"role": "user", "content": "Hi"}], foo=1)


def test_bad_model_arguments(smollm2_path):
    for kw, said in ((dict(n_ctx=2**31), "n_ctx must be at most"), (dict(n_threads=100000), "n_threads must be at most"),
                     (dict(placed_copy="yes"), "placed_copy")):
        with pytest.raises(optiml.ArgumentError, match=said):
            optiml.Model(smollm2_path, **kw)
    with pytest.raises(optiml.ArgumentError, match="a path or a model name"):
        optiml.Model(42)


def _generator(m, ids, n_cached=0, max_tokens=16, stops=(), **sampling):
    sampler = Sampler(m.n_vocab, **sampling)
    return _core.Generator(m._session, m.tokenizer._t, sampler._s, np.array(ids, np.int32), n_cached, max_tokens,
                           [s.encode() for s in stops])


def test_run_to_end_equals_iteration(model):
    ids = model.tokenize("Once upon a time")
    model.reset()
    a = "".join(_generator(model, ids, max_tokens=40, temperature=0.9, seed=9))
    model.reset()
    g = _generator(model, ids, max_tokens=40, temperature=0.9, seed=9)
    assert g.run_to_end() == a and g.finished
    n = len(g.tokens)
    assert g.stats["gen_tokens"] == n and 0 < n <= 40
    assert g.n_evaluated == (n - 1 if n == 40 else n)  # the last token runs only when an EOG token followed it
    assert g.context_tokens == ids + g.tokens[: g.n_evaluated] and model.n_past == len(ids) + g.n_evaluated
    with pytest.raises(StopIteration):
        next(g)


def test_generator_errors(model):
    model.reset()
    with pytest.raises(optiml.ArgumentError, match="n_cached"):
        _generator(model, PROMPT_IDS, n_cached=3)  # the context holds nothing
    with pytest.raises(optiml.ArgumentError, match="n_cached"):
        _generator(model, PROMPT_IDS, n_cached=5)
    with pytest.raises(optiml.ArgumentError, match="empty"):
        _generator(model, [])
    with pytest.raises(optiml.ArgumentError, match="stop"):
        _generator(model, PROMPT_IDS, stops=("",))
    with pytest.raises(optiml.ArgumentError, match="max_tokens"):
        _generator(model, PROMPT_IDS, max_tokens=-1)
    with pytest.raises(optiml.ArgumentError, match="sampler"):
        _core.Generator(model._session, model.tokenizer._t, _core.Sampler(10, 0.8, 40, 0.95, 0.05, 1.0, 64, 0, 0, 1),
                        np.array(PROMPT_IDS, np.int32), 0, 4, [])
    g = _generator(model, list(range(100, 600)) + [1] * 20)  # 520 tokens, n_ctx 512
    with pytest.raises(optiml.ContextOverflowError, match="n_ctx=512"):
        next(g)
    with pytest.raises(StopIteration):  # a failed generator is finished
        next(g)
    assert g.context_tokens == [] and model.n_past == 0


def test_steps_release_the_gil_and_refuse_a_second_thread(model):
    model.reset()
    g = _generator(model, PROMPT_IDS, max_tokens=200, temperature=0.8, seed=1)
    refused = []

    def poke():
        # Can only run while the main thread is inside a step if that step released the GIL.
        while not refused:
            try:
                if g.finished:
                    return
            except optiml.OptimlError as e:
                refused.append(str(e))

    t = threading.Thread(target=poke)
    t.start()
    g.run_to_end()
    t.join()
    assert refused and "another thread" in refused[0]
