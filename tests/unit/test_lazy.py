"""``core.lazy``: a module named lazily is imported at its first attribute lookup and then takes the proxy's place;
``no_grad`` is ``@torch.no_grad()`` without importing torch at definition. Fresh interpreters, so that "not yet
imported" means something."""

import subprocess
import sys

import pytest
import torch

from sage_grpo.core.lazy import no_grad
from tests.helpers import worker_environment

pytestmark = pytest.mark.unit


def _run_python(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], env=worker_environment(), capture_output=True, text=True, check=True, timeout=300
    )
    return done.stdout.split()


def test_a_lazy_module_is_imported_at_first_lookup_and_then_replaces_the_proxy():
    code = """
import sys
from sage_grpo.core.lazy import lazy_module
colorsys = lazy_module("colorsys", globals())
held = [colorsys]  # a reference taken before the first lookup, outside the globals
print("colorsys" in sys.modules)
print(colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0))
print(colorsys is sys.modules["colorsys"], held[0] is not colorsys, held[0].hls_to_rgb is colorsys.hls_to_rgb)
"""
    assert _run_python(code) == ["False", "True", "True", "True", "True"]


def test_a_missing_module_fails_at_first_use_with_the_import_error():
    code = """
from sage_grpo.core.lazy import lazy_module
missing = lazy_module("no_such_module_anywhere", globals())
try:
    missing.anything
except ModuleNotFoundError as error:
    print(error.name)
"""
    assert _run_python(code) == ["no_such_module_anywhere"]


def test_no_grad_imports_torch_when_called_not_when_defined():
    code = """
import sys
from sage_grpo.core.lazy import no_grad

@no_grad
def double(x):
    return x * 2

print("torch" in sys.modules)
"""
    assert _run_python(code) == ["False"]


def test_no_grad_runs_the_function_without_gradients_and_keeps_its_name():
    @no_grad
    def scaled(x: torch.Tensor) -> torch.Tensor:
        """Twice x."""
        return x * 2

    weights = torch.ones(3, requires_grad=True)
    out = scaled(weights)
    assert not out.requires_grad and torch.equal(out, torch.full((3,), 2.0))
    assert (scaled.__name__, scaled.__doc__) == ("scaled", "Twice x.")
    assert (weights * 2).requires_grad  # outside, gradients are on again
