"""Which Hub revision a run used: a path inside the Hugging Face cache's layout
(`<cache>/<type>s--<org>--<name>/snapshots/<commit>/...`) names its repository and commit, and
the cache's `refs/<branch>` files name the branch that resolved to it. The launch plan and
run.json record this for every such path a run is given, so a run fetched at `main` still says
which commit it trained on. Torch-free.
"""

from __future__ import annotations

import re
from pathlib import Path

_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_FOLDER = re.compile(r"(models|datasets|spaces)--(.+)")


def snapshot_revision(path: str | Path) -> dict | None:
    """{repo_id, repo_type, commit, refs} of a path in a Hub cache snapshot, else None.

    `commit` is None when the folder is not yet a commit (a dry run names `snapshots/main` before
    anything is fetched); `refs` are the branch names whose ref file holds the commit."""
    parts = Path(path).parts
    for i in range(1, len(parts) - 1):
        repo = _REPO_FOLDER.fullmatch(parts[i - 1])
        if parts[i] != "snapshots" or repo is None:
            continue
        folder = parts[i + 1]
        commit = folder if _COMMIT.fullmatch(folder) else None
        repo_dir = Path(*parts[:i])
        return {"repo_id": repo.group(2).replace("--", "/"), "repo_type": repo.group(1)[:-1],
                "commit": commit, "refs": _refs_naming(repo_dir, commit) if commit else [folder]}
    return None


def _refs_naming(repo_dir: Path, commit: str) -> list[str]:
    refs = repo_dir / "refs"
    try:
        files = sorted(p for p in refs.rglob("*") if p.is_file())
    except OSError:
        return []
    return [str(p.relative_to(refs)) for p in files if _read(p) == commit]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def hub_revisions_in_argv(argv: list[str]) -> dict[str, dict]:
    """For each flag of `argv` with a value in a Hub cache snapshot (any of its values:
    `--eval-prompt-data NAME PATH`): that snapshot's revision."""
    found: dict[str, dict] = {}
    flag = None
    for word in argv:
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            if not eq:
                continue
        elif flag is None:
            continue
        else:
            value = word
        revision = snapshot_revision(value)
        if revision is not None:
            found[flag] = revision
    return found
