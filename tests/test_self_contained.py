"""A clone alone runs its own tests (issue #49): no code under tests/ or tools/ reads a folder beside the
checkout or a path of one particular machine. Test data lives in tests/data; models are fetched into the
package's cache (optiml.hub.registry.cache_dir: $OPTIML_MODEL_CACHE, else $OPTIML_HOME/models, else the default)."""

import ast
import re

from conftest import ROOT

OUTSIDE = [
    (re.compile(r'"\.\."\s*,\s*"\.\."'), 'os.path.join(..., "..", "..")'),
    (re.compile(r"\.parent\.parent\.parent"), "Path(...).parent.parent.parent"),
    (re.compile(r"/work/|/root/|/home/\w"), "a machine's absolute path"),
    (re.compile(r"~/\.cache/optiml"), "the default cache spelled out (use optiml.hub.registry.cache_dir())"),
]


def docstring_lines(tree: ast.AST) -> set:
    """Line numbers of docstrings (usage examples may name paths; they are not read)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.update(range(first.lineno, first.end_lineno + 1))
    return out


def test_nothing_reads_outside_the_checkout():
    bad = []
    for path in sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("tools/**/*.py")]):
        if path.name == "test_self_contained.py":
            continue
        text = path.read_text(encoding="utf-8")
        skip = docstring_lines(ast.parse(text))
        for i, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in OUTSIDE:
                if i not in skip and pattern.search(code):
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {what}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_tools_do_not_import_the_tests():
    """A tool runs from an installed package and a checkout alike: nothing under tools/ imports a module of
    tests/ (conftest, fidelity, ...), which an installed package has not got."""
    test_modules = {p.stem for p in ROOT.glob("tests/*.py")}
    bad = []
    for path in sorted(ROOT.glob("tools/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {n}" for n in names
                    if n.split(".")[0] in test_modules]
    assert not bad, "\n".join(bad)
