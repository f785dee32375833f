"""Runs one Python fuzz target of targets.py under atheris: python atheris_main.py TARGET [libFuzzer args].
tools/checks/fuzz.py is the usual way in."""

import sys

import atheris

with atheris.instrument_imports(include=["optiml", "targets", "jinja2"]):
    import jinja2  # noqa: F401  (instrumented: template coverage is mostly jinja2's own code)
    import optiml  # noqa: F401
    import optiml.engine.chat_template  # noqa: F401
    import optiml.convert  # noqa: F401
    import optiml.formats.placement  # noqa: F401
    import targets


def main():
    name = sys.argv[1]
    fn = targets.TARGETS[name][0]
    atheris.Setup([sys.argv[0]] + sys.argv[2:], fn)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
