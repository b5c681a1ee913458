"""The recipe test harness, a pytest plugin (see docs/testing.md).

Registered for this repository by the root `conftest.py`; elsewhere load it with
`pytest -p miles.testing`. Importing it pulls in neither torch nor Ray.
"""

from miles.testing.cases import (
    CPU_PROXY_ARGS,
    RecipeCase,
    Tolerance,
    case_of,
    discover_recipes,
    dry_cases,
    find_repo_root,
    parametrize_cases,
)
from miles.testing.plugin import (  # noqa: F401  (hooks and fixtures: this module is the plugin)
    check_run,
    check_static,
    dry_run,
    gpu_lease,
    miles_repo_root,
    model_cache_dir,
    plan_snapshot,
    pytest_addoption,
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    ray_cluster,
    recipe_case,
    run_recipe,
)

__all__ = [
    "CPU_PROXY_ARGS",
    "RecipeCase",
    "Tolerance",
    "case_of",
    "discover_recipes",
    "dry_cases",
    "find_repo_root",
    "parametrize_cases",
]
