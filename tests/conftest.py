"""Suite-wide collection order: `make test` runs the suite on two pytest-xdist workers that take
whole test files (`--dist loadfile`) in collection order, so the files holding end-to-end runs
(a `slow` test, minutes each) go first and the many short files fill the workers' gaps at the
end instead of leaving one worker alone with a long file."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept within
