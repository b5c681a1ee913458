#!/usr/bin/env python3
"""Re-records the e2e metric standards of the named test cases.

    python3 ci/record_standards.py NAME [NAME ...]      # case names or pytest node ids
    python3 ci/record_standards.py --dry-run NAME       # print the pytest command only

Runs those cases for real with `--miles-record-standards`, which rewrites their files under
tests/e2e/standards/; review the diff and commit it. CI never records standards: a run that
re-records its own reference can never fail, so this refuses to run under GitHub Actions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this file's directory is on sys.path instead of the repository root
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ci.cases import Case, CollectError, collect_cases  # noqa: E402

STANDARDS_DIR = "tests/e2e/standards"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", help="case names (as in the suite summary) or node ids")
    p.add_argument("--tests", default="tests/e2e", help="where the harness's cases live")
    p.add_argument("--workdir", type=Path, default=REPO, help="where pytest runs")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    return p.parse_args(argv)


def resolve(names: list[str], cases: list[Case]) -> tuple[list[str], list[str]]:
    """Node ids for the names, and the names that match no case."""
    by_name = {c.name: c.nodeid for c in cases if c.nodeid}
    known_ids = set(by_name.values())
    nodeids, unknown = [], []
    for name in names:
        if name in by_name:
            nodeids.append(by_name[name])
        elif "::" in name and (name in known_ids or not cases):
            nodeids.append(name)
        else:
            unknown.append(name)
    return nodeids, unknown


def record_command(nodeids: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *nodeids, "--miles-record-standards",
            "-p", "no:cacheprovider", "-q"]


def in_ci() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if in_ci():
        print("refusing to record standards inside CI; record them on a machine you trust and "
              "commit the diff", file=sys.stderr)
        return 2
    needs_lookup = any("::" not in n for n in args.names)
    try:
        cases = collect_cases(args.tests, args.workdir) if needs_lookup else []
    except CollectError as err:
        print(err, file=sys.stderr)
        return 2
    nodeids, unknown = resolve(args.names, cases)
    if unknown:
        print(f"no such case: {', '.join(unknown)}", file=sys.stderr)
        return 2
    cmd = record_command(nodeids)
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    code = subprocess.run(cmd, cwd=args.workdir).returncode
    subprocess.run(["git", "status", "--short", "--", STANDARDS_DIR], cwd=args.workdir)
    print(f"review the changes under {STANDARDS_DIR} and commit them with the reason")
    return code


if __name__ == "__main__":
    sys.exit(main())
