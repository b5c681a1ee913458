"""miles.utils.safetensors_headers: a whole file's tensor names from its header; a file cut short
anywhere (in the length, the header or the data) is refused with what is wrong, without torch."""

from __future__ import annotations

import json
import struct

import pytest

from miles.utils.safetensors_headers import HeaderError, read_header, tensor_names


def _whole(tmp_path, name="w.safetensors"):
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "blocks.0.to_q.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                         "blocks.0.to_q.bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    return path


def test_a_whole_file_gives_its_tensor_names_without_the_metadata(tmp_path):
    _whole(tmp_path)
    assert sorted(read_header(tmp_path / "w.safetensors")) == ["blocks.0.to_q.bias", "blocks.0.to_q.weight"]
    assert sorted(tensor_names(tmp_path)) == ["blocks.0.to_q.bias", "blocks.0.to_q.weight"]
    assert tensor_names(tmp_path / "nothing-here") is None  # no safetensors file: another format


@pytest.mark.parametrize("keep", [4, 8, 40, -1])  # in the length, the header, the data (one byte short)
def test_a_file_cut_short_anywhere_is_refused(tmp_path, keep):
    path = _whole(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(HeaderError):
        read_header(path)
