"""Where an export may write: never into, around or over what it reads.

`--out` is refused when it is, contains or lies inside the run directory, its checkpoints
directory, the checkpoint, the base checkpoint or the path given to read, or lies inside any run
or checkpoints directory. `--overwrite` replaces only a folder an earlier export wrote: every
export leaves a marker file in its folder, and a folder without one is someone's data.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.export.errors import ExportError

MARKER = ".miles-export.json"
# what marks a folder the export must not write into or over (a pipeline export holds
# model_index.json too, so the base is protected by its path, not by that file)
_RECORDS = {"run.json": "a run directory", "latest": "a checkpoints directory", "trainer.json": "a checkpoint"}


def check_destination(out: Path, source, given: Path, overwrite: bool) -> None:
    """Refuse an --out that would touch what the export reads, or that is not ours to replace."""
    target = out.resolve()
    protected = {
        "the run directory": source.run_dir,
        "its checkpoints directory": source.checkpoint.parent,
        "the checkpoint": source.checkpoint,
        "the base checkpoint (the run's --hf-checkpoint)": source.base,
        "the path given to export": given,
    }
    for what, path in protected.items():  # the exact match first: "is its checkpoints directory"
        if target == path.resolve():
            raise ExportError(f"--out {out} is {what} ({path}); an export never writes where it reads: "
                              f"pick an --out outside it")
    for what, path in protected.items():
        _refuse_overlap(out, target, what, path.resolve())
    for ancestor in target.parents:
        for record, what in _RECORDS.items():
            if (ancestor / record).is_file():
                raise ExportError(f"--out {out} lies inside {what} ({ancestor} holds {record}); "
                                  f"an export never writes into training output: pick an --out outside it")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ExportError(f"--out {out} exists; pass --overwrite to replace an earlier export there, or another --out")
    if not out.is_dir() or not (out / MARKER).is_file():
        raise ExportError(f"--out {out} exists and is not an earlier export (no {MARKER} in it); --overwrite "
                          f"replaces only an export's folder: pick another --out, or move {out} away yourself")
    for record, what in _RECORDS.items():
        inside = next(out.rglob(record), None)
        if inside is not None:
            raise ExportError(f"--out {out} holds {what} ({inside}); --overwrite would delete it: "
                              f"pick another --out, or move it out of {out} yourself")


def _refuse_overlap(out: Path, target: Path, what: str, path: Path) -> None:
    if path in target.parents:
        raise ExportError(f"--out {out} lies inside {what} ({path}); an export never writes where it reads: "
                          f"pick an --out outside it")
    if target in path.parents:
        raise ExportError(f"--out {out} contains {what} ({path}); replacing it would delete what the export "
                          f"reads: pick an --out outside it")


def write_marker(folder: Path, source) -> None:
    """The file that lets a later `--overwrite` know this folder is an export's."""
    record = {"exported_from": str(source.checkpoint), "rollout_id": source.rollout_id, "family": source.family}
    (folder / MARKER).write_text(json.dumps(record, indent=1) + "\n")
