"""A whole pipeline folder: the exported transformer(s) plus the base's other components.

The base's files are hard-linked where the file system allows (no second copy of the text
encoders; a link stays valid if the base is deleted) and copied otherwise, so the folder is
self-contained: `DiffusionPipeline.from_pretrained(out)` and a Hub upload need nothing else.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(src, dst)


def add_base_components(out: Path, base: Path, exported: list[str]) -> None:
    """Everything of `base` except the exported components' folders and its README."""
    for src in sorted(base.rglob("*")):
        relative = src.relative_to(base)
        if src.is_dir() or relative.parts[0] in exported or relative.parts[0].startswith("."):
            continue
        if relative == Path("README.md"):
            continue  # the export writes its own model card
        link_or_copy(src, out / relative)
