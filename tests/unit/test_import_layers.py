"""No import runs from a lower room of the package to a higher one.

The layer order is written once, in docs/architecture.md ("Dependencies point one way"): one line
per entry point (the recipes, the trainer, the tests), each a chain of layers from the top down.
This test reads every such line. A room is a dotted name under `miles`; a module belongs to the
longest room its name starts with. Every `import miles.X` / `from miles.X import ...` counts, also the ones inside functions (a
lazy import is still a dependency). A room may import a room that some chain puts in its own layer
or below it, and nothing else. One file is named here, not in the doc: the façade that keeps
miles-diffusion's `import miles.utils.external_utils.command_utils as U`, which imports the launcher
and nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARROW = "──>"
ROOM = re.compile(r"^miles\.([a-z_.]+)$")
FACADE = Path("utils/external_utils/command_utils.py")  # relative to the package
FACADE_MAY_IMPORT = "launcher"


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
        if path.relative_to(package) == FACADE:
            problems += [f"{path.relative_to(package.parent)}:{line} imports {module} (the façade imports only "
                         f"miles.{FACADE_MAY_IMPORT})" for line, module in miles_imports(path)
                         if room_of(module.removeprefix("miles."), rooms) != FACADE_MAY_IMPORT]
            continue
        for line, module in miles_imports(path):
            target = room_of(module.removeprefix("miles."), rooms)
            if target != room and (room, target) not in allowed:
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {module} "
                                f"({room} may not depend on {target})")
    return problems


def test_the_layer_order_is_read_from_the_architecture_doc():
    below_models = [{"plan"}, {"flags"}, {"records"}, {"diffusion_facts"}, {"utils"}]
    assert chains_from_doc() == [
        [{"launcher"}, {"proxy_assets"}, {"rollout"}, {"models"}, *below_models],
        [{"ray"}, {"backends", "rollout"}, {"models"}, *below_models],
        [{"testing"}, {"launcher"}, *below_models],
        [{"export"}, {"backends"}, {"models"}, *below_models],
        [{"replay"}, {"testing"}, {"backends", "rollout"}, {"models"}, *below_models],
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
        "flags/x.py": "def f():\n    from miles.plan.memory_plan import plan_and_check\n",
        "launcher/x.py": "from miles.proxy_assets.checkpoint import ensure_checkpoint\n",
        "proxy_assets/x.py": "from miles.ray.faults import ROSTER\n",
        "utils/external_utils/command_utils.py": "from miles.launcher.config import ExecuteTrainConfig\n"
                                                 "from miles.testing.dry import dry_run\n",
        "utils/external_utils/other.py": "from miles.launcher.config import ExecuteTrainConfig\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert upward_imports(package, chains_from_doc()) == [
        "miles/flags/x.py:2 imports miles.plan.memory_plan (flags may not depend on plan)",
        "miles/models/x.py:2 imports miles.rollout.types (models may not depend on rollout)",
        "miles/proxy_assets/x.py:1 imports miles.ray.faults (proxy_assets may not depend on ray)",
        "miles/testing/x.py:1 imports miles.ray.faults (testing may not depend on ray)",
        "miles/utils/external_utils/command_utils.py:2 imports miles.testing.dry (the façade imports only "
        "miles.launcher)",
        "miles/utils/external_utils/other.py:1 imports miles.launcher.config (utils may not depend on launcher)",
        "miles/utils/x.py:2 imports miles.launcher.recipe_assets (utils may not depend on launcher)",
    ]


def module_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (lazy included); `from miles.x import y` counts
    as importing miles.x.y where that is a module."""
    names = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("miles."):
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & names.keys()
                targets |= subs or {node.module}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.startswith("miles.")}
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of imports, as the path from a module back to itself (one per strongly connected part)."""
    circles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(path + [start])
                    done.update(path)
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return circles


def test_no_module_imports_itself_through_a_circle_of_others():
    assert import_circles(module_graph(REPO / "miles")) == []


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    package = tmp_path / "miles"
    (package / "launcher").mkdir(parents=True)
    (package / "launcher" / "a.py").write_text("from miles.launcher.b import g\n")
    (package / "launcher" / "b.py").write_text("def g():\n    from miles.launcher import a\n")
    assert import_circles(module_graph(package)) == [["miles.launcher.a", "miles.launcher.b", "miles.launcher.a"]]
