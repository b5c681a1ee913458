"""No import runs from a lower room of the package to a higher one.

The layer order is written once, in docs/architecture.md ("Dependencies point one way"): one line
per entry point (the recipes, the trainer, the tests), each a chain of layers from the top down.
This test reads every such line. A room is a dotted name under `miles` (`miles.utils.external_utils`
is a room of its own inside `miles.utils`); a module belongs to the longest room its name starts
with. Every `import miles.X` / `from miles.X import ...` counts, also the ones inside functions (a
lazy import is still a dependency). A room may import a room that some chain puts in its own layer
or below it, and nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARROW = "──>"
ROOM = re.compile(r"^miles\.([a-z_.]+)$")


def chains_from_doc(doc: Path = REPO / "docs" / "architecture.md") -> list[list[set[str]]]:
    """Each arrow line of the doc's first code block, as its layers of rooms, top layer first;
    what is not a room of the package (`scripts/run_*.py`, `tests/`) is dropped."""
    block = doc.read_text().split("```")[1]
    chains = []
    for line in (line for line in block.splitlines() if ARROW in line):
        layers = [{m.group(1) for name in part.split(",") if (m := ROOM.match(name.strip()))}
                  for part in line.split(ARROW)]
        chains.append([layer for layer in layers if layer])
    return chains


def allowed_pairs(chains: list[list[set[str]]]) -> set[tuple[str, str]]:
    """(importer, imported) for every room and each room in its layer or below, in some chain."""
    return {(upper, lower) for chain in chains for i, layer in enumerate(chain)
            for upper in layer for below in chain[i:] for lower in below}


def room_of(module: str, rooms: set[str]) -> str:
    """The longest room `module` (dotted, without `miles.`) lies in; its first part if none."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rooms:
            return ".".join(parts[:n])
    return parts[0]


def miles_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("miles."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("miles.")]
    return found


def upward_imports(package: Path, chains: list[list[set[str]]]) -> list[str]:
    allowed = allowed_pairs(chains)
    rooms = {room for chain in chains for layer in chain for room in layer}
    problems = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).with_suffix("")
        if len(relative.parts) < 2:
            continue
        room = room_of(".".join(relative.parts), rooms)
        for line, module in miles_imports(path):
            target = room_of(module.removeprefix("miles."), rooms)
            if target != room and (room, target) not in allowed:
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {module} "
                                f"({room} may not depend on {target})")
    return problems


def test_the_layer_order_is_read_from_the_architecture_doc():
    assert chains_from_doc() == [
        [{"utils.external_utils"}, {"proxy_assets"}, {"rollout"}, {"models"}, {"utils"}],
        [{"ray"}, {"backends", "rollout"}, {"models"}, {"utils"}],
        [{"testing"}, {"utils.external_utils"}, {"utils"}],
        [{"export"}, {"backends"}, {"models"}, {"utils"}],
        [{"replay"}, {"testing"}, {"backends", "rollout"}, {"models"}, {"utils"}],
    ]


def test_the_chains_agree_on_the_order_of_every_two_rooms():
    pairs = allowed_pairs(chains_from_doc())
    assert sorted((a, b) for a, b in pairs if a != b and (b, a) in pairs) == [("backends", "rollout"),
                                                                             ("rollout", "backends")]


def test_no_room_of_the_package_imports_a_room_above_it():
    assert upward_imports(REPO / "miles", chains_from_doc()) == []


def test_an_upward_import_is_found_also_inside_a_function(tmp_path):
    package = tmp_path / "miles"
    files = {
        "models/x.py": "def f():\n    from miles.rollout.types import SamplingParams\n",
        "rollout/x.py": "from miles.models.loader import load_model\n",
        "testing/x.py": "import miles.ray.faults\n",
        "utils/x.py": "def f():\n    from miles.launcher.recipe_assets import Assets\n",
        "utils/external_utils/x.py": "from miles.proxy_assets.checkpoint import ensure_checkpoint\n",
        "proxy_assets/x.py": "from miles.ray.faults import ROSTER\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert upward_imports(package, chains_from_doc()) == [
        "miles/models/x.py:2 imports miles.rollout.types (models may not depend on rollout)",
        "miles/proxy_assets/x.py:1 imports miles.ray.faults (proxy_assets may not depend on ray)",
        "miles/testing/x.py:1 imports miles.ray.faults (testing may not depend on ray)",
        "miles/utils/x.py:2 imports miles.launcher.recipe_assets "
        "(utils may not depend on utils.external_utils)",
    ]
