"""No import runs from a lower room of the package to a higher one.

The layer order is written once, in docs/architecture.md ("Dependencies point one way"); this test
reads it from there. Every `import miles.X` / `from miles.X import ...` counts, also the ones
inside functions (a lazy import is still a dependency). Rooms of one layer may import each other;
`miles.testing` may import only the bottom layer (the launcher and the flag validation live there).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHAIN_START = "train_diffusion.py ──>"


def layers_from_doc(doc: Path = REPO / "docs" / "architecture.md") -> list[set[str]]:
    """[{'ray'}, {'backends', 'rollout'}, {'models'}, {'utils'}]: top layer first."""
    line = next(line for line in doc.read_text().splitlines() if line.startswith(CHAIN_START))
    return [{name.strip().removeprefix("miles.") for name in part.split(",")} for part in line.split("──>")[1:]]


def miles_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("miles."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("miles.")]
    return found


def upward_imports(package: Path, layers: list[set[str]]) -> list[str]:
    rank = {room: i for i, rooms in enumerate(layers) for room in rooms}
    bottom = len(layers) - 1
    problems = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if len(parts) < 2:
            continue
        room = parts[0]
        for line, module in miles_imports(path):
            target = module.split(".")[1]
            if target == room:
                continue
            allowed = rank[target] >= rank[room] if room in rank else rank.get(target) == bottom
            if not allowed:
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {module} "
                                f"({room} may not depend on {target})")
    return problems


def test_the_layer_order_is_read_from_the_architecture_doc():
    assert layers_from_doc() == [{"ray"}, {"backends", "rollout"}, {"models"}, {"utils"}]


def test_no_room_of_the_package_imports_a_room_above_it():
    assert upward_imports(REPO / "miles", layers_from_doc()) == []


def test_an_upward_import_is_found_also_inside_a_function(tmp_path):
    package = tmp_path / "miles"
    for room, text in {"models": "def f():\n    from miles.rollout.types import SamplingParams\n",
                       "rollout": "from miles.models.loader import load_model\n",
                       "testing": "import miles.ray.faults\n"}.items():
        (package / room).mkdir(parents=True)
        (package / room / "x.py").write_text(text)
    problems = upward_imports(package, layers_from_doc())
    assert problems == ["miles/models/x.py:2 imports miles.rollout.types (models may not depend on rollout)",
                        "miles/testing/x.py:1 imports miles.ray.faults (testing may not depend on ray)"]
