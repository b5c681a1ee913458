"""Rules for the whole test tree and the committed standards: no expected failure that can pass
unnoticed, no standard that pins nothing."""

import ast
import json
from pathlib import Path

import pytest

from miles.testing.standards import constant_series

# the marker name, spelled in two pieces so a plain text search for the marker finds real uses only
MARKER = "x" + "fail"

REPO = Path(__file__).resolve().parents[3]
STANDARDS = sorted((REPO / "tests" / "e2e" / "standards").glob("*.json"))


def _xfail_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.endswith("mark." + MARKER) or name in ("pytest." + MARKER, MARKER):
                yield name, node
        elif isinstance(node, ast.Attribute) and ast.unparse(node).endswith("mark." + MARKER):
            yield "bare", node  # the bare marker, without a call, is never strict


def xfail_violations(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    problems = []
    for name, node in _xfail_calls(tree):
        where = f"{filename}:{node.lineno}"
        if name == "bare":
            if id(node) not in called:
                problems.append(f"{where}: bare @pytest.mark.{MARKER} (needs strict=True and a reason)")
            continue
        if name in ("pytest." + MARKER, MARKER):
            problems.append(f"{where}: imperative pytest.{MARKER}() cannot be strict; use the marker")
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        strict = keywords.get("strict")
        if not (isinstance(strict, ast.Constant) and strict.value is True):
            problems.append(f"{where}: xfail without strict=True")
        if "reason" not in keywords:
            problems.append(f"{where}: xfail without a reason")
    return problems


def test_every_xfail_in_the_tree_is_strict_and_gives_a_reason():
    problems = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        problems += xfail_violations(path.read_text(), str(path.relative_to(REPO)))
    assert problems == []


def test_the_xfail_rule_catches_non_strict_bare_and_imperative_forms():
    non_strict = "strict=" + "False"
    source = (
        "import pytest\n"
        f"@pytest.mark.{MARKER}({non_strict}, reason='x')\ndef test_a(): pass\n"
        f"@pytest.mark.{MARKER}\ndef test_b(): pass\n"
        f"def test_c():\n    pytest.{MARKER}('later')\n"
        f"@pytest.mark.{MARKER}(strict=True, reason='known bug #1')\ndef test_d(): pass\n"
    )
    problems = xfail_violations(source, "t.py")
    assert [p.split(":")[1] for p in problems] == ["2", "4", "7"]


def test_pytest_makes_xfail_strict_by_default():
    import tomllib

    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini.get("xfail_strict") is True


@pytest.mark.parametrize("path", STANDARDS, ids=[p.stem for p in STANDARDS])
def test_committed_standard_pins_something_and_says_what_it_was_recorded_on(path):
    standard = json.loads(path.read_text())
    assert constant_series(standard) == []
    fingerprint = standard.get("fingerprint") or {}
    for key in ("cpu_isa", "cpu_vendor", "torch_cpu_capability", "numerics", "torch_threads", "packages"):
        assert fingerprint.get(key), f"{path.name}: fingerprint lacks {key}"
    assert fingerprint["packages"].get("torch"), path.name


def test_there_are_committed_standards():
    assert len(STANDARDS) >= 9
