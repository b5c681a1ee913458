"""docs/memory-plan.md's replay table: every recipe x every GPU scale, replayed (extrapolated depth).

    python3 -m miles.replay.doc_table            # print the table
    python3 -m miles.replay.doc_table --write    # rewrite it in docs/memory-plan.md

The table sits between TABLE_BEGIN and TABLE_END; tests/unit/replay/test_recipes.py checks that
each case's committed rows are the ones its replay prints, so the table cannot go stale.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TABLE_BEGIN = "<!-- replay table: python3 -m miles.replay.doc_table --write -->"
TABLE_END = "<!-- end of the replay table -->"
HEADER = ["| recipe | scale | GPU | phase | measured GiB | plan GiB | budget GiB | verdict |",
          "|---|---|---|---|---|---|---|---|"]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def cases(root: Path | None = None) -> list[tuple[str, str]]:
    """(recipe path relative to the repo, scale) for every recipe's every GPU scale."""
    from miles.replay.recipe import recipe_scales
    from miles.testing.cases import RECIPE_PATTERN, discover_recipes

    root = root or repo_root()
    return [(script, scale) for script in discover_recipes(root, RECIPE_PATTERN)
            for scale in recipe_scales(root / script)]


def committed_rows(doc: Path | None = None) -> list[str]:
    text = (doc or repo_root() / "docs" / "memory-plan.md").read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return []
    block = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    return [line for line in block.strip().splitlines() if line.startswith("| `")]


def rows_of(rows: list[str], recipe: str, scale: str) -> list[str]:
    name = Path(recipe).stem
    return [r for r in rows if r.startswith(f"| `{name}` | {scale} |")]


def build_table(root: Path | None = None) -> list[str]:
    from miles.replay.report import replay_recipe

    root = root or repo_root()
    lines = list(HEADER)
    for script, scale in cases(root):
        lines += replay_recipe(root / script, scale, extrapolate=True).table_rows()
    return lines


def write_table(lines: list[str], doc: Path) -> None:
    text = doc.read_text()
    before, rest = text.split(TABLE_BEGIN, 1)
    after = rest.split(TABLE_END, 1)[1]
    doc.write_text(before + TABLE_BEGIN + "\n" + "\n".join(lines) + "\n" + TABLE_END + after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m miles.replay.doc_table", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/memory-plan.md")
    ns = parser.parse_args(argv)
    lines = build_table()
    if ns.write:
        write_table(lines, repo_root() / "docs" / "memory-plan.md")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
