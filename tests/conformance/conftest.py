from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Plain asserts in the helpers report their operands like asserts in the tests.
pytest.register_assert_rewrite("conformance_utils")


@pytest.fixture(scope="session")
def native_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], Any]], Any]:
    """`native_run(key, scenario)`: the native-mode result of a scenario, computed once per session.

    The library-mode test of a scenario compares its final `TrainerState` with the native
    run's; the native test usually ran first and filled the cache.
    """
    cache: dict[str, Any] = {}

    def get(key: str, scenario: Callable[[Path], Any]) -> Any:
        if key not in cache:
            cache[key] = scenario(tmp_path_factory.mktemp(f"native-{key}"))
        return cache[key]

    return get
