"""Module docstrings state a contract a reader can trust: short, naming only files that exist, and every
package's ``__init__`` a complete map of its modules (issue 47, item 4)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nbdist"
MAX_LINES = 12
ENGINES: tuple[str, ...] = ()
# A file named in prose: ``foo.py``, ``pkg/foo.py``, ``docs/x.md``, ``benchmarks/y.py`` (not a URL's tail).
FILE_NAME = re.compile(r"(?<![\w/.:-])([\w.-]+/)*[\w-]+\.(?:py|md)(?![\w-])")
MAP_ENTRY = re.compile(r"^([\w-]+\.py|[\w-]+/): ", re.MULTILINE)


def _owned_by_engines(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    return any(rel == name or name.endswith("/") and rel.startswith(name) for name in ENGINES)


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def missing_files(path: Path, doc: str) -> list[str]:
    """The file names in ``doc`` (of the module at ``path``) that exist neither beside the module, nor under
    nbdist/, nor under the repository's root."""
    bases = (path.parent, PACKAGE, REPO)
    return [m.group(0) for m in FILE_NAME.finditer(doc) if not any((b / m.group(0)).exists() for b in bases)]


def map_mismatch(init: Path, doc: str) -> tuple[set[str], set[str]]:
    """(omitted, gone): the package's modules and subpackages its ``__init__`` map does not name, and the
    map's entries (``name.py: ...`` or ``name/: ...`` at a line's start) that are not in the package."""
    package = init.parent
    present = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    present |= {p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    named = set(MAP_ENTRY.findall(doc))
    return present - named, named - present


def prose_lines(path: Path, doc: str) -> int:
    """A docstring's lines; in a package's ``__init__``, its map's one line per module not counted."""
    lines = doc.splitlines()
    if path.name == "__init__.py":
        lines = [line for line in lines if not MAP_ENTRY.match(line)]
    return len(lines)


def test_docstrings_name_only_files_that_exist() -> None:
    bad = [f"{p.relative_to(REPO)}: {name}" for p in _modules() if not _owned_by_engines(p)
           for name in missing_files(p, _docstring(p))]
    assert not bad, "module docstrings name files that do not exist:\n" + "\n".join(bad)


def test_every_package_init_maps_its_modules() -> None:
    bad = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if _owned_by_engines(init):
            continue
        omitted, gone = map_mismatch(init, _docstring(init))
        if omitted or gone:
            bad.append(f"{init.relative_to(REPO)}: omits {sorted(omitted)}, names gone {sorted(gone)}")
    assert not bad, "package maps (one 'name.py: what it holds' line per module) out of date:\n" + "\n".join(bad)


def test_module_docstrings_are_short() -> None:
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in _modules() if not _owned_by_engines(p)
            for n in [prose_lines(p, _docstring(p))] if n > MAX_LINES]
    assert not long, f"module docstrings over {MAX_LINES} lines (the contract; measurements go to " \
                     "benchmarks/RESULTS.md):\n" + "\n".join(long)


def test_the_checks_catch_what_they_guard() -> None:
    """Each check flags a made-up case, so a green run means something."""
    module = PACKAGE / "data" / "inputs.py"
    assert missing_files(module, "see sharding.py, worker/streams.py and docs/data.md") == []
    assert missing_files(module, "see shardings.py and docs/nothing.md, not https://x.org/a.py") == [
        "shardings.py", "docs/nothing.md"]
    init = PACKAGE / "data" / "__init__.py"
    omitted, gone = map_mismatch(init, "Data.\n\nfiles.py: x\nnothing.py: y\n")
    assert "inputs.py" in omitted and gone == {"nothing.py"}
    assert prose_lines(init, "a\n\nfiles.py: x\ninputs.py: y") == 2
    assert prose_lines(module, "a\n\nfiles.py: x\ninputs.py: y") == 4
