"""What a safetensors file holds, read from its header alone (no torch, no tensor data read).

The format: 8 bytes (little-endian u64) giving the header's length, the header (JSON: tensor
name -> dtype, shape, data_offsets), then the data. A file cut short, or one whose header does not
parse, is found here in microseconds, before a run loads it minutes later.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


class HeaderError(ValueError):
    """The file is not a whole safetensors file; the message says what is wrong with it."""


def read_header(path: str | Path) -> dict:
    """The header of `path` (tensor name -> entry, `__metadata__` dropped); HeaderError if the file is
    not whole: too short, a header that does not parse, or tensor data past its end."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise HeaderError(f"{size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise HeaderError(f"its header claims {length} bytes, the file has {size} (cut short?)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise HeaderError(f"its header does not parse ({err})") from None
    if not isinstance(header, dict):
        raise HeaderError("its header is not a JSON object")
    header.pop("__metadata__", None)
    end = max((entry.get("data_offsets", [0, 0])[1] for entry in header.values() if isinstance(entry, dict)),
              default=0)
    if 8 + length + end > size:
        raise HeaderError(f"its tensors need {8 + length + end} bytes, the file has {size} (cut short?)")
    return header


def tensor_names(folder: str | Path) -> list[str] | None:
    """The tensor names of every *.safetensors file in `folder` (a diffusers component), from their
    headers; None when the folder has no safetensors file (weights in another format)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    names: list[str] = []
    for path in files:
        names += list(read_header(path))
    return names
