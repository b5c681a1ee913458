"""JUnit XML and the Markdown summary of a suite run."""

import xml.etree.ElementTree as ET

from ci.history import Verdict
from ci.junit import write_junit
from ci.results import CaseResult, outcome_from_junit
from ci.summary import RunFacts, render, write_summary


def results():
    gate_fail = Verdict("slow", "fail", ["throughput 70 vs 100 (median of 5): -30.0%, allowed -10%"],
                        ["torch 2.11.0+cu128 -> 2.11.0+cu130"])
    return [
        CaseResult("ok", "t.py::ok", 2, 60.0, outcome="passed", gpus=("0", "1"), wall_time=55.0),
        CaseResult("broken", "t.py::broken", 1, 60.0, outcome="failed", message="assert 1 == 2",
                   gpus=("2",), wall_time=10.0, log_tail="E   assert 1 == 2\x1b[0m\x00"),
        CaseResult("skip", "t.py::skip", 4, 60.0, outcome="skipped", message="needs 4 GPUs"),
        CaseResult("slow", "t.py::slow", 1, 60.0, outcome="passed", gpus=("3",), wall_time=80.0,
                   verdict=gate_fail),
        CaseResult("hang", "t.py::hang", 1, 60.0, outcome="timeout", message="ended after 600s"),
    ]


def facts():
    return RunFacts("nightly", ("0", "1", "2", "3"), 3700.0, 3600.0, 3800.0, "/db.sqlite")


def test_junit_counts_failures_gate_failures_timeouts_and_skips(tmp_path):
    path = tmp_path / "junit.xml"
    write_junit(path, "nightly", results(), 100.0)
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "5", "3", "0", "1")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["broken"].find("failure").text.startswith("E   assert 1 == 2")
    assert cases["slow"].find("failure").get("type") == "gate"
    assert "torch 2.11.0+cu128 -> 2.11.0+cu130" in cases["slow"].find("failure").get("message")
    assert cases["skip"].find("skipped").get("message") == "needs 4 GPUs"
    assert cases["ok"].find("failure") is None


def test_junit_written_for_a_run_reads_back_as_pytest_outcomes(tmp_path):
    path = tmp_path / "junit.xml"
    write_junit(path, "nightly", results()[:1], 1.0)
    assert outcome_from_junit(path) == ("passed", "")


def test_summary_names_failures_gate_and_environment_change():
    text = render(facts(), results())
    assert text.startswith("## Suite `nightly`: FAILED (3 of 5)")
    assert "ratio 1.028" in text
    assert "| `slow` | 3 | ✅ passed |" in text
    assert "torch 2.11.0+cu128 -> 2.11.0+cu130" in text
    assert "<summary><code>broken</code>: assert 1 == 2</summary>" in text
    assert "<summary><code>hang</code>: ended after 600s</summary>" in text


def test_summary_of_a_green_run_says_passed():
    assert render(facts(), results()[:1]).startswith("## Suite `nightly`: passed")


def test_summary_is_appended_to_the_github_step_summary(tmp_path, monkeypatch):
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    write_summary(tmp_path / "summary.md", "## Suite `x`: passed\n")
    assert step.read_text() == "earlier step\n## Suite `x`: passed\n\n"
    assert (tmp_path / "summary.md").read_text() == "## Suite `x`: passed\n"
