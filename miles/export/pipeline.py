"""A whole pipeline folder: the exported transformer(s) plus the base's other components.

The base's files are hard-linked where the file system allows (no second copy of the text
encoders; a link stays valid if the base is deleted) and copied otherwise, so the folder is
self-contained: `DiffusionPipeline.from_pretrained(out)` and a Hub upload need nothing else.
Its model_index.json is written, not linked (the base's stays as it is): a one-CLIP SD3 base gets
the stand-in encoders of stand_ins.py, named there, so `StableDiffusion3Pipeline.from_pretrained(out)` loads and encodes a prompt with no arguments.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def link_or_copy(src: Path, dst: Path) -> None:
    """A link shares the base file's mode: a private one (0600, as safetensors writes) is copied
    instead, so the export's files get the ordinary permissions a team can read."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not src.stat().st_mode & 0o044:
        shutil.copy(src, dst)
        return
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(src, dst)


def add_base_components(out: Path, base: Path, exported: list[str], family: str) -> None:
    """Everything of `base` except the exported components' folders and its README, and a
    model_index.json naming the stand-ins a one-CLIP SD3 needs (stand_ins.py)."""
    from miles.export.stand_ins import needs_stand_ins, write_stand_ins

    for src in sorted(base.rglob("*")):
        relative = src.relative_to(base)
        if src.is_dir() or relative.parts[0] in exported or relative.parts[0].startswith("."):
            continue
        if relative in (Path("README.md"), Path("model_index.json")):
            continue  # the export writes its own model card and index
        link_or_copy(src, out / relative)
    index = json.loads((base / "model_index.json").read_text())
    if needs_stand_ins(family, base):
        index = write_stand_ins(out, base, index)
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
