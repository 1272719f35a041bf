"""Every third-party package the code imports is declared in pyproject.toml, and the production constraints pin
every declared dependency and every extra the image installs (so the scheduled image installs the versions the tests
ran with, or for extras the suite does not install, versions chosen by hand)."""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"core", "stages", "pipeline"}
# Modules of the image's extras that the test venv (CPU) does not install, so no installed distribution names them.
NOT_INSTALLED_HERE = {"pynvml": ["nvidia-ml-py"]}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _imported_top_level() -> set[str]:
    names = set()
    for package in FIRST_PARTY:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - {"sage_grpo"} - set(sys.stdlib_module_names)


def test_every_imported_package_is_declared():
    distributions = NOT_INSTALLED_HERE | packages_distributions()
    missing = {
        name: distributions.get(name)
        for name in _imported_top_level()
        if not {canonicalize_name(d) for d in distributions.get(name, [name])} & _declared()
    }
    assert missing == {}


def _image_extras() -> list[str]:
    """The extras the Dockerfile installs with the constraints (``pip install -c ... ".[video,gpu]"``)."""
    found = re.search(
        r'pip install -c constraints/production\.txt "\.\[([a-z,]+)\]"', (ROOT / "Dockerfile").read_text()
    )
    assert found, "the Dockerfile no longer installs the package with the production constraints"
    return found.group(1).split(",")


def test_the_production_constraints_pin_every_dependency_and_the_images_extras():
    pins = {}
    for line in (ROOT / "constraints" / "production.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            pins[canonicalize_name(requirement.name)] = str(requirement.specifier)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [text for extra in _image_extras() for text in project["optional-dependencies"][extra]]
    assert "nvidia-ml-py>=12,<14" in extras  # the gpu extra: GPU system metrics in the image
    for text in project["dependencies"] + extras:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name), "")
        assert pinned.startswith("=="), f"{requirement.name} is not pinned in constraints/production.txt"
        assert requirement.specifier.contains(pinned[2:]), f"{requirement.name}{pinned} is outside {requirement}"
