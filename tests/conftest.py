"""Suite-wide collection order, for ``scripts/test.sh``'s pytest-xdist run."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a slow test first, otherwise in collection order. xdist's loadfile hands out whole files in this
    order (test.sh turns off its own reordering, which puts the files with the most tests first): a file of several
    minutes handed out last would leave the other workers idle while it finishes, and the suite is CPU-bound."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
