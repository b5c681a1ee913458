"""The recipe test harness, a pytest plugin (see docs/testing.md).

Registered for this repository by the root `conftest.py`; elsewhere load it with
`pytest -p miles.testing`. Importing it pulls in neither torch nor Ray.
"""

from miles.testing.cases import (
    CPU_PROXY_ARGS,
    RecipeCase,
    Signal,
    Tolerance,
    case_of,
    discover_recipes,
    dry_cases,
    find_repo_root,
    parametrize_cases,
)
# The hooks and fixtures live in miles.testing.plugin; pytest loads it along with this module
# (from the root conftest.py's `pytest_plugins`, or from `-p miles.testing`).
pytest_plugins = ["miles.testing.plugin"]

__all__ = [
    "CPU_PROXY_ARGS",
    "RecipeCase",
    "Signal",
    "Tolerance",
    "case_of",
    "discover_recipes",
    "dry_cases",
    "find_repo_root",
    "parametrize_cases",
]
