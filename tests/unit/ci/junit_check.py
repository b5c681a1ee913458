"""What the runner's tests hold a JUnit file to: the structure CI test reporters parse."""

import xml.etree.ElementTree as ET

OUTCOME_TAGS = ("failure", "error", "skipped")


def junit_problems(path):
    root = ET.parse(path).getroot()
    if root.tag != "testsuites":
        return [f"root is <{root.tag}>, not <testsuites>"]
    problems = []
    for suite in root.findall("testsuite"):
        cases = suite.findall("testcase")
        counted = {tag: sum(c.find(tag) is not None for c in cases) for tag in OUTCOME_TAGS}
        expected = {"tests": len(cases), "failures": counted["failure"],
                    "errors": counted["error"], "skipped": counted["skipped"]}
        for attr, value in expected.items():
            if suite.get(attr) != str(value):
                problems.append(f"{suite.get('name')}: {attr}={suite.get(attr)}, counted {value}")
        for case in cases:
            if not case.get("name") or not case.get("classname"):
                problems.append("a testcase lacks name or classname")
            float(case.get("time"))
            if sum(case.find(tag) is not None for tag in OUTCOME_TAGS) > 1:
                problems.append(f"{case.get('name')}: more than one outcome")
    return problems
