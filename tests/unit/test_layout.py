"""The house has three floors and every import points down: pipeline (application) -> stages -> core (foundation)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOORS = ["core", "stages", "pipeline"]  # bottom to top

pytestmark = pytest.mark.unit


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _imported_packages(path: Path) -> set[str]:
    """The floors a module imports (``sage_grpo.stages.update`` -> ``stages``)."""
    return {name.split(".")[1] for name in _imported_modules(path) if name.startswith("sage_grpo.") and "." in name}


@pytest.mark.parametrize("package", FLOORS)
def test_imports_only_point_down(package):
    above = set(FLOORS[FLOORS.index(package) + 1 :])
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_packages(path) & above)
        for path in (ROOT / package).rglob("*.py")
        if _imported_packages(path) & above
    }
    assert offenders == {}, f"{package}/ imports a higher floor"


def test_floors_are_imported_only_under_the_installed_name():
    """A bare ``import core`` would work in a checkout and break beside another distribution's ``core``."""
    bare = {
        str(path.relative_to(ROOT)): sorted(name for name in _imported_modules(path) if name.split(".")[0] in FLOORS)
        for folder in [*FLOORS, "benchmarks", "tests"]
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: names for path, names in bare.items() if names} == {}


def test_command_lines_are_parsed_only_in_the_cli_and_the_launcher():
    parsers = {
        str(path.relative_to(ROOT))
        for package in FLOORS
        for path in (ROOT / package).rglob("*.py")
        if "ArgumentParser(" in path.read_text() or "add_parser(" in path.read_text()
    }
    # pipeline.launch parses only its own flags before handing the rest to torchrun.
    assert parsers == {"pipeline/cli.py", "pipeline/launch.py"}


def test_no_module_imports_another_modules_private_names():
    """A leading underscore says "only this module relies on it": a helper another module needs is made public where
    it belongs (``core.files`` for file helpers), so renaming a private one never breaks a distant import."""
    private = {
        f"{path.relative_to(ROOT)}:{node.lineno}": f"{node.module}.{alias.name}"
        for package in FLOORS
        for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sage_grpo")
        for alias in node.names
        if alias.name.startswith("_")
    }
    assert private == {}
