"""Rules for the whole suite."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The unit tier (``scripts/test.sh -m unit``) stays fast by construction: a test marked ``slow`` cannot also be a
    unit test, so no module's ``pytestmark = pytest.mark.unit`` lets a minute-long test into it. Every collection
    checks it, ``-m unit`` included (its deselection comes after this hook)."""
    both = [item.nodeid for item in items if item.get_closest_marker("unit") and item.get_closest_marker("slow")]
    if both:
        raise pytest.UsageError(f"marked both unit and slow (the unit tier is the fast one): {', '.join(both)}")
