"""Hostile input: chat templates that loop, flood or allocate without end; the fuzz targets for a fixed
number of inputs (coverage-guided under atheris when it is installed, random mutations of the seeds
otherwise); the server under a short soak of valid, cancelled, malformed, oversize and slow requests."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import optiml
from optiml import OptimlError
from optiml.engine.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, TemplateLimitError

ROOT = Path(__file__).resolve().parent.parent
# Children import the same optiml this process did (installed under CI, the source tree in a dev loop).
CHILD_ENV = dict(os.environ, PYTHONPATH=str(Path(optiml.__file__).resolve().parent.parent) + os.pathsep
                 + os.environ.get("PYTHONPATH", ""))
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
import targets  # noqa: E402

MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("source, what", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}", "output exceeds"),
    ("{{ 'x' * 1000000000 }}", "repeated value"),
    ("{{ ([1] * 100000) * 100000 }}", "repeated value"),
    ("{{ 10 ** 100000000 }}", "exponents"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    ("{{ 'x'|center(1000000000) }}", "width"),
    ("{{ 'a\nb'|indent(1000000000) }}", "width"),
    ("{{ '%*s' % (1000000000, 'x') }}", "formatted value"),
    ("{{ '%1000000000s' % 'x' }}", "formatted value"),
    ("{{ '%1000000000s'|format('x') }}", "format width"),
    ("{{ '{:>1000000000}'.format('x') }}", "format width"),
    ("{{ 'x'.ljust(1000000000) }}", "argument"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "concatenated"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "concatenated"),
])
def test_template_limits(source, what):
    tpl = ChatTemplate(source)
    # Only the endless loop meets the time limit; the others must be stopped by their own check first.
    tpl.max_render_seconds = 0.3 if what == "longer than" else 120
    with pytest.raises(TemplateLimitError, match=what) as e:
        tpl.render(MSGS)
    assert isinstance(e.value, OptimlError)


def test_template_limits_leave_normal_templates_alone():
    out = ChatTemplate("{{ '%5s|%d' % ('x', 3) }}{{ 'ab'|center(6) }}{{ 2 ** 10 }}{{ 'ab' * 3 }}"
                       "{{ '{:>3}'.format('x') }}{{ 'x'.ljust(3) }}|").render(MSGS)
    assert out == "    x|3  ab  1024ababab  xx  |"
    long = [{"role": "user", "content": "word " * 50_000}]  # 250 kB of conversation renders
    assert len(ChatTemplate(CHATML_TEMPLATE).render(long)) > 250_000


def test_template_output_limit_is_adjustable():
    tpl = ChatTemplate(CHATML_TEMPLATE)
    tpl.max_output_chars = 10
    with pytest.raises(TemplateLimitError, match="exceeds 10 characters"):
        tpl.render(MSGS)


def test_template_sandbox_holds():
    for source in ["{{ messages.__class__.__mro__[1].__subclasses__() }}",
                   "{{ cycler.__init__.__globals__.os.popen('id').read() }}", "{{ messages.append(1) }}"]:
        with pytest.raises(ChatTemplateError, match="blocked by the sandbox") as e:
            ChatTemplate(source, name="hostile.gguf").render(MSGS)
        assert e.value.problem == "blocked" and "hostile.gguf" in str(e.value)


def test_hostile_templates_end_as_optiml_errors():
    """Each hostile template of the fuzz corpus (and the seeds: real templates, the fallbacks) either renders
    or raises a ChatTemplateError naming the template: no raw jinja2 or Python exception (issue #47)."""
    raw = []
    for source in targets.template_seeds():
        try:
            tpl = ChatTemplate(source.decode(), "<s>", "</s>", name="corpus.gguf")
            tpl.max_render_seconds = 0.5
            tpl.render(MSGS + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "{{ 7 * 7 }}"}])
        except ChatTemplateError as e:
            assert isinstance(e, OptimlError) and e.template == "the chat template of corpus.gguf"
            assert str(e).startswith(e.template)
        except Exception as e:  # noqa: BLE001 (what the test counts)
            raw.append((source[:60], repr(e)))
    assert raw == []


def test_template_limits_do_not_leak_a_trace_function():
    ChatTemplate(CHATML_TEMPLATE).render(MSGS)
    assert sys.gettrace() is None or "coverage" in repr(sys.gettrace()) or "pydevd" in repr(sys.gettrace())


# ---- the fuzz targets, a fixed number of inputs ---------------------------------------------------------
RUNS = {"template": 1500, "tokenizer": 1500, "gguf": 200, "convert": 150}


def _mutate(b: bytes, rng: random.Random) -> bytes:
    b = bytearray(b)
    for _ in range(rng.randint(1, 8)):
        if not b:
            break
        i = rng.randrange(len(b))
        op = rng.randrange(5)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i:i + 4] = rng.choice([b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80"])
        elif op == 2:
            del b[i:i + rng.randint(1, 16)]
        elif op == 3:
            del b[i:]
        else:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randint(1, 32)]
    return bytes(b)


def _atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fuzz_target(name, tmp_path):
    fn, seeds = targets.TARGETS[name]
    regressions = ROOT / "tests" / "fuzz" / "regressions" / ("py-" + name)
    inputs = seeds() + ([p.read_bytes() for p in sorted(regressions.iterdir())] if regressions.is_dir() else [])
    for x in inputs:
        fn(x)
    if _atheris():  # coverage-guided, in a child (atheris takes over the process)
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "checks" / "fuzz.py"), "py-" + name, "--runs", str(RUNS[name]),
                            "--corpus", str(tmp_path / "corpus"),
                            # a busy CI machine can stall one input for a while: hangs are the campaigns' job
                            "--timeout", "20"], capture_output=True, text=True, timeout=600,
                           env=CHILD_ENV)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        # libFuzzer counts the run that hit the limit too, so "Done 151 runs" for -runs=150 happens
        done = re.search(r"Done (\d+) runs", r.stderr)
        assert done and int(done.group(1)) >= RUNS[name], r.stderr[-4000:]
    else:
        rng = random.Random(0)
        for _ in range(RUNS[name] // 4):
            fn(_mutate(rng.choice(inputs), rng))


# ---- the server under a short soak ------------------------------------------------------------------------
def test_soak_serve_short(tmp_path):
    pytest.importorskip("uvicorn")
    import seeds

    model = tmp_path / "tiny.gguf"
    seeds.write_model(model, optiml_keys=False)
    # A tiny model's server is about 64 MiB. Concurrent refused 16 MiB bodies leave the allocator holding
    # up to ~20 MiB afterwards (glibc keeps freed heap: +27% measured once in CI, 1-9% locally), which is
    # not a leak; a leak that matters over 300 requests (>= 100 KiB each) still exceeds 50%. The 5% bound
    # of the issue is the full soak's (tools/checks/soak_serve.py on SmolLM2, 2000 requests).
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "checks" / "soak_serve.py"), "-m", str(model), "--requests", "300",
                        "--clients", "6", "--parallel", "2", "--queue", "8", "--ctx", "128", "--threads", "1",
                        "--max-seconds", "240", "--rss-tolerance", "0.5"],
                       capture_output=True, text=True, timeout=600,
                       env=CHILD_ENV)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "failures: 0" in r.stdout


# ---- regressions found by fuzzing ------------------------------------------------------------------------
def test_messages_quoting_bytes_that_are_not_utf8(tmp_path):
    """py-gguf found it: an architecture name with a byte that is not UTF-8 made optiml.Model raise
    UnicodeDecodeError (the message could not become a Python string) instead of UnsupportedModelError.
    A file name that is not UTF-8 loads too."""
    import shutil

    import seeds

    bad = ROOT / "tests" / "fuzz" / "regressions" / "py-gguf" / "arch-not-utf8"
    with pytest.raises(optiml.UnsupportedModelError, match=r"architecture 'l\\x8cama' is not supported"):
        optiml.Model(bad)
    name = os.fsdecode(os.fsencode(str(tmp_path)) + b"/model-\xff.gguf")
    seeds.write_model(os.fsencode(name).decode("utf-8", "surrogateescape"), optiml_keys=False)
    assert len(optiml.Model(name, n_ctx=16).generate("the", max_tokens=2, temperature=0)) >= 0
    shutil.copy(bad, name)
    with pytest.raises(optiml.UnsupportedModelError, match=r"model-\\xff\.gguf: architecture"):
        optiml.Model(name)


def test_deeply_nested_template_is_a_limit_error():
    """py-template found it: '{{{{{{...' nested a few hundred deep made jinja2's parser raise RecursionError
    while the template was compiled."""
    source = (ROOT / "tests" / "fuzz" / "regressions" / "py-template" / "deep-nesting").read_bytes()
    with pytest.raises(TemplateLimitError, match="nests too deeply"):
        ChatTemplate(source.decode("utf-8", "replace"))
    with pytest.raises(TemplateLimitError, match="nests too deeply"):
        ChatTemplate("{{" + "(" * 5000 + "1" + ")" * 5000 + "}}")
