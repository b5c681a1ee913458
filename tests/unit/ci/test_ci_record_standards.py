"""Re-recording metric standards: named cases only, never inside CI."""

import pytest

from ci import record_standards
from ci.cases import Case

CASES = [Case("wan22_cpu", 0, 60.0, nodeid="tests/e2e/test_recipes.py::test_cpu[wan22]"),
         Case("sd3_cpu", 0, 60.0, nodeid="tests/e2e/test_recipes.py::test_cpu[sd3]")]


@pytest.fixture(autouse=True)
def outside_ci(monkeypatch):
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.setattr(record_standards, "collect_cases", lambda tests, workdir: CASES)


def test_names_resolve_to_node_ids_and_the_command_records_standards(capsys):
    assert record_standards.main(["--dry-run", "wan22_cpu"]) == 0
    out = capsys.readouterr().out
    assert "tests/e2e/test_recipes.py::test_cpu[wan22]" in out
    assert "--miles-record-standards" in out
    assert "sd3" not in out


def test_unknown_name_is_refused(capsys):
    assert record_standards.main(["--dry-run", "nope"]) == 2
    assert "no such case: nope" in capsys.readouterr().err


def test_refuses_to_run_inside_github_actions(monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert record_standards.main(["--dry-run", "wan22_cpu"]) == 2
    assert "refusing" in capsys.readouterr().err
