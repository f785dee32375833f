"""The layout of python/optiml: subpackages on levels, imports only downward, no import cycles, short functions
(in native/ too).

Read from the source with ast (nothing is imported): every `import optiml...` and `from ... import ...` that
names a module of the package, at a module's top or inside a function, relative ones resolved.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "python" / "optiml"

# The level of each part of the package: a module may import from its own level and the levels below.
LEVELS = {
    "_core": 0,  # the native module: exceptions, kernels, the engine
    "_version": 0,
    "util": 1,  # atomic files, sizes, memory, paths
    "formats": 2,  # GGUF reading and rewriting, quant types, stats, placement, predictor files
    "hub": 3,  # where model files come from: the registry, the Hugging Face Hub
    "engine": 4,  # optiml.Model and its parts
    "offline": 5,  # profile, calibrate, predictor training, hardware, solve
    "evaluate": 5,  # perplexity, KL divergence
    "convert": 5,  # Hugging Face checkpoints to GGUF
    "server": 6,  # optiml serve
    "cli": 7,  # the optiml command
    "__init__": 8,  # the top package: the public API, gathered
    "__main__": 8,  # python -m optiml
}
MAX_FUNCTION_LINES = 120


def _module_name(path: Path) -> str:
    parts = ["optiml", *path.relative_to(PKG).with_suffix("").parts]
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()  # a subpackage is named by its folder
    elif parts == ["optiml", "__init__"]:
        return "optiml"
    return ".".join(parts)


SOURCES = {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}
MODULES = set(SOURCES) | {"optiml._core"}


def _part(module: str) -> str:
    """The entry of LEVELS a module belongs to."""
    if module == "optiml":
        return "__init__"
    return module.split(".")[1]


def _is_package(module: str) -> bool:
    return module == "optiml" or SOURCES[module].name == "__init__.py"


def _imports(module: str) -> list[tuple[str, int]]:
    """(imported optiml module, line) of every import in a module, wherever it stands."""
    tree = ast.parse(SOURCES[module].read_text(), str(SOURCES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "optiml" or alias.name.startswith("optiml."):
                    found.append((alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == "optiml" or base.startswith("optiml.")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return found


GRAPH = {m: _imports(m) for m in SOURCES}


def test_every_part_has_a_level_and_every_folder_is_a_package():
    assert "optiml.engine.model" in SOURCES, f"no package source under {PKG}"
    assert sorted({_part(m) for m in MODULES} - set(LEVELS)) == [], "add the new part to LEVELS"
    folders = {p.parent for p in SOURCES.values()}
    assert sorted(str(f) for f in folders if not (f / "__init__.py").is_file()) == []


def test_imports_only_go_down():
    upward = []
    for module, imports in GRAPH.items():
        for target, line in imports:
            if target not in MODULES:
                upward.append(f"{SOURCES[module]}:{line}: {module} imports {target}, which is no module of the "
                              "package (an alias such as optiml.gguf is for users; import the real module)")
            elif _part(target) not in LEVELS or _part(module) not in LEVELS:
                continue  # test_every_part_has_a_level says which
            elif LEVELS[_part(target)] > LEVELS[_part(module)]:
                upward.append(f"{SOURCES[module]}:{line}: {module} (level {LEVELS[_part(module)]}) imports {target} "
                              f"(level {LEVELS[_part(target)]})")
    assert not upward, "imports must go to the same level or below:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = {m: sorted({t for t, _ in imports if t in SOURCES and t != m}) for m, imports in GRAPH.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_functions_are_short():
    long = []
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno}: {module}.{node.name} has {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("name", ["gguf", "quant", "sampling", "tokenizer", "plan"])
def test_the_public_module_names_stay(name):
    import importlib

    import optiml

    module = importlib.import_module(f"optiml.{name}")
    assert getattr(optiml, name) is module and module.__name__.startswith("optiml.")


# ---- native/: short functions too ---------------------------------------------------------------------------
NATIVE = PKG.parent.parent / "native"
_NOT_A_FUNCTION = re.compile(r"^(if|for|while|switch|do|else|return|try|catch)\b")
_TYPE_HEAD = re.compile(r"\b(namespace|struct|class|enum|union)\b[^()]*$")


def _blank_comments_and_literals(src: str) -> str:
    """C++ source with comments and string/char literals emptied, newlines kept (so braces inside them do
    not count and line numbers stay)."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * src.count("\n", i, j))
            i = j
        elif src[i] in "\"'":
            j = i + 1
            while j < n and src[j] != src[i] and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            out.append(src[i] * 2)
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def _native_functions(path: Path) -> list[tuple[int, int, str]]:
    """(lines from the opening brace to the closing one, line of the opening brace, signature) of every
    function body that is not inside another (lambdas and local blocks count as their function's lines)."""
    src = _blank_comments_and_literals(path.read_text(encoding="utf-8", errors="replace"))
    found, stack, head, line = [], [], [], 1
    for ch in src:
        if ch == "\n":
            line += 1
        if ch == "{":
            text = "".join(head).strip()
            last = text.split("\n")[-1].strip() if text else ""
            is_function = (not any(kind == "function" for kind, _, _ in stack) and ")" in text
                           and not _NOT_A_FUNCTION.match(last) and not _TYPE_HEAD.search(text) and not text.endswith("="))
            stack.append(("function" if is_function else "block", line, " ".join(text.split())[:100]))
            head = []
        elif ch == "}":
            if stack:
                kind, first, sig = stack.pop()
                if kind == "function":
                    found.append((line - first + 1, first, sig))
            head = []
        elif ch == ";":
            head = []
        else:
            head.append(ch)
    return found


def test_native_functions_are_short():
    files = [p for p in sorted(NATIVE.rglob("*")) if p.suffix in (".cpp", ".h", ".cu", ".cuh")]
    assert len(files) > 50
    n_functions, long = 0, []
    for p in files:
        for n, first, sig in _native_functions(p):
            n_functions += 1
            if n > MAX_FUNCTION_LINES:
                long.append(f"{p.relative_to(NATIVE.parent)}:{first}: {sig} has {n} lines")
    assert n_functions > 500  # the scan found the functions (a broken scan would pass vacuously)
    assert not long, f"native functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
