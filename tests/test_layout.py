"""The house's rules that no other test sees: the floors of the package, and docs that live in the project.

- ``gcomp.pruning`` (making masks) is the ground floor: it imports nothing from pactrain (reducing a masked
  bucket), nor from the hook, the methods or the collectives;
- the benchmark is the top floor: only ``gcomp/bench/`` and ``gcomp/cli.py`` import ``gcomp.bench``, and
  ``import gcomp`` loads none of it;
- ``gcomp.link`` (the link model ``auto`` and the benchmark share) imports nothing from the floors above it;
- files are cut by concept, not by a line count: ``gcomp/compressors/`` holds one folder per method family, whose
  ``__init__`` registers its methods, and no module is under 40 lines unless it is a package's face (an
  ``__init__.py``) or ``__main__.py``;
- nothing in the code, the tests, the examples, the README or ``docs/`` cites a file that is not in the
  repository (a design note or spec kept elsewhere), and every repository path they name exists;
- every asynchronous collective's future is taken through ``gcomp.collectives.launch.launched``, so the hook
  can settle it before the main thread goes on.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_FILES = sorted([*ROOT.glob("gcomp/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("examples/*.py"),
                     *ROOT.glob("docs/*.md"), ROOT / "README.md"])
ABOVE_PRUNING = ("gcomp.compressors", "gcomp.collectives", "gcomp.hook", "gcomp.bench", "gcomp.registry",
                 "gcomp.core", "gcomp.method")
ABOVE_LINK = ("gcomp.bench", "gcomp.auto", "gcomp.fsdp", "gcomp.hook", "gcomp.installer", "gcomp.compressors")
MAY_IMPORT_BENCH = ("gcomp/bench/", "gcomp/cli.py")
MIN_LINES = 40
# A repository path as prose names it: a top-level folder of the project, then a file or folder.
REPO_PATH = re.compile(r"(?<![\w./-])((?:gcomp|tests|examples|docs)/[\w./-]*\w)")
ELSEWHERE = re.compile(r"DESIGN\.md|ALGORITHMS\.md|specs/|specs §|\.\./shared")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _module_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every module ``path`` imports, relative imports resolved against its package, and
    ``from a import b`` read as both ``a`` and ``a.b`` (``b`` may be a module: ``from gcomp import bench``).
    ``importlib.import_module`` and ``__import__`` of a literal name count too."""
    return _imports_in(path.read_text(), path.relative_to(ROOT).parts[:-1])


def _imports_in(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """``_module_imports`` of ``source``, a module of ``package`` (``("gcomp", "auto")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if module:
                found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}" if module else alias.name) for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def _within(module: str, packages) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


@pytest.mark.parametrize("path", sorted(ROOT.glob("gcomp/pruning/*.py")), ids=lambda p: p.name)
def test_pruning_imports_nothing_from_the_floors_above(path):
    above = sorted(n for n in _imports(path) if n.startswith(ABOVE_PRUNING))
    assert not above, f"{path.relative_to(ROOT)} imports {above}"


def test_nothing_cites_a_file_outside_the_repository():
    cited = []
    for path in TEXT_FILES:
        if path == Path(__file__).resolve():
            continue  # the patterns themselves
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ELSEWHERE.search(line):
                cited.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not cited, "citations of files that are not in the repository:\n" + "\n".join(cited)


def test_every_repository_path_named_exists():
    missing = []
    for path in TEXT_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in REPO_PATH.findall(line):
                name = name.rstrip(".")
                if "*" in name or "DATE" in name or not Path(name).suffix and "/" not in name[:-1]:
                    continue
                if not (ROOT / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", sorted(ROOT.glob("gcomp/**/*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_collectives_futures_are_taken_through_launched(path):
    if path.relative_to(ROOT).as_posix() == "gcomp/collectives/launch.py":
        return
    calls = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_future"]
    assert not calls, f"{path.name}: .get_future() on line(s) {calls}; use gcomp.collectives.launch.launched(work)"


@pytest.mark.parametrize("path", sorted(ROOT.glob("gcomp/**/*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_bench_and_cli_import_bench(path):
    name = path.relative_to(ROOT).as_posix()
    if name.startswith(MAY_IMPORT_BENCH):
        return
    lines = {}
    for line, module in _module_imports(path):
        if _within(module, ("gcomp.bench",)):
            lines[line] = min(lines.get(line, module), module, key=len)
    found = [f"{name}:{line}: {module}" for line, module in sorted(lines.items())]
    assert not found, ("only gcomp/bench/ and gcomp/cli.py may import the benchmark (the link model is gcomp.link):\n"
                       + "\n".join(found))


def test_import_gcomp_loads_no_bench_module():
    code = "import gcomp, sys; print([m for m in sys.modules if m.startswith('gcomp.bench')])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"import gcomp loads the benchmark: {done.stdout.strip()}"


@pytest.mark.parametrize("path", sorted(ROOT.glob("gcomp/link/*.py")), ids=lambda p: p.name)
def test_link_imports_only_the_floors_below(path):
    above = sorted({f"{line}: {module}" for line, module in _module_imports(path) if _within(module, ABOVE_LINK)})
    assert not above, f"{path.relative_to(ROOT)} imports from the floors above gcomp.link: {above}"


@pytest.mark.parametrize("path", sorted(ROOT.glob("gcomp/**/*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_under_40_lines_but_a_packages_face(path):
    if path.name in ("__init__.py", "__main__.py"):
        return
    lines = len(path.read_text().splitlines())
    assert lines >= MIN_LINES, (f"{path.relative_to(ROOT)} has {lines} lines: too small to be an idea of its own "
                                "(join it to the module whose idea it serves)")


def test_the_compressors_are_one_folder_per_family_each_registering_its_methods():
    import gcomp

    folder = ROOT / "gcomp" / "compressors"
    loose = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"gcomp/compressors/ holds modules outside a family folder: {loose}"
    families = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    homes: dict[str, set[str]] = {}
    for name in gcomp.available():
        module = gcomp.spec(name).factory.__module__
        assert module.startswith("gcomp.compressors."), f"{name} is registered from {module}"
        homes.setdefault(module.split(".")[2], set()).add(name)
    assert set(homes) == families, f"families without a method: {sorted(families - set(homes))}"


def _graph(room) -> dict[str, set[str]]:
    """Imports between the modules of ``gcomp`` (the package's face, ``gcomp/__init__.py``, left out: it only hands
    names on), each module mapped by ``room`` (to itself, or to its top-level file or folder)."""
    modules = {}
    for path in ROOT.glob("gcomp/**/*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "gcomp":
            modules[name] = path
    edges: dict[str, set[str]] = {room(m): set() for m in modules}
    for name, path in modules.items():
        found = _module_imports(path)
        for line, imported in found:
            while imported and imported not in modules:  # ``from a.b import name``: the module a.b
                imported = imported.rpartition(".")[0]
            if any(line == other_line and other.startswith(imported + ".") and other in modules
                   for other_line, other in found):
                continue  # ``from a import b`` of a module b: b, not the package's face
            if imported and room(imported) != room(name):
                edges[room(name)].add(room(imported))
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One loop of ``edges``, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


@pytest.mark.parametrize("level", ["modules", "rooms"])
def test_imports_make_no_circle(level):
    """No module imports itself back through others, nor does a top-level file or folder of ``gcomp`` (a room): the
    floors are then well defined, and every import runs down them."""
    room = (lambda m: m) if level == "modules" else (lambda m: ".".join(m.split(".")[:2]))
    loop = _cycle(_graph(room))
    assert loop is None, " -> ".join(loop)
