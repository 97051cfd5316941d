"""The house's rules that no other test sees: the floors of the package, and docs that live in the project.

- ``gcomp.pruning`` (making masks) is the ground floor: it imports nothing from ``gcomp.packing`` (reducing a
  masked bucket), nor from the hook, the methods or the collectives;
- nothing in the code, the tests, the examples, the README or ``docs/`` cites a file that is not in the
  repository (a design note or spec kept elsewhere), and every repository path they name exists;
- every asynchronous collective's future is taken through ``gcomp.collectives.futures.launched``, so the hook
  can settle it before the main thread goes on.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_FILES = sorted([*ROOT.glob("gcomp/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("examples/*.py"),
                     *ROOT.glob("docs/*.md"), ROOT / "README.md"])
ABOVE_PRUNING = ("gcomp.packing", "gcomp.compressors", "gcomp.collectives", "gcomp.hook", "gcomp.bench",
                 "gcomp.registry", "gcomp.memory")
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
    if path.relative_to(ROOT).as_posix() == "gcomp/collectives/futures.py":
        return
    calls = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_future"]
    assert not calls, f"{path.name}: .get_future() on line(s) {calls}; use gcomp.collectives.futures.launched(work)"
