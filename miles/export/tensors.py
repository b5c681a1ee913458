"""The trained tensors of a checkpoint, read a few at a time.

Data-parallel checkpoints hold whole tensors in `<kind>_<component>.safetensors`; fsdp ones hold
each rank's shards in torch.distributed.checkpoint (DCP) files under the keys
`<kind>.<component>.<param name>`, with their global shapes in `.metadata`. Both readers answer
the same two questions: which tensors there are (name -> shape, dtype, from headers only) and the
whole values of a few named ones. A reader never loads more than it is asked for, so a caller
that asks one output shard at a time holds at most one shard set in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MODEL, EMA = "model", "ema"
KIND_KEY = {MODEL: "params", EMA: "ema"}  # the top-level keys of miles.backends.fsdp's saved state


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


class DpTensors:
    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint

    def _file(self, kind: str, component: str) -> Path:
        return self.checkpoint / f"{kind}_{component}.safetensors"

    def components(self, kind: str) -> list[str]:
        return sorted(p.name[len(kind) + 1:-len(".safetensors")] for p in self.checkpoint.glob(f"{kind}_*.safetensors"))

    def infos(self, kind: str, component: str) -> dict[str, TensorInfo]:
        from safetensors import safe_open

        with safe_open(str(self._file(kind, component)), framework="pt") as f:
            return {n: TensorInfo(tuple(f.get_slice(n).get_shape()), safetensors_dtype(f.get_slice(n).get_dtype()))
                    for n in f.keys()}

    def read(self, kind: str, component: str, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(str(self._file(kind, component)), framework="pt") as f:
            return {n: f.get_tensor(n) for n in names}


class FsdpTensors:
    def __init__(self, checkpoint: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.checkpoint = checkpoint
        self.metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata

    def _entries(self, kind: str) -> dict[str, TensorInfo]:
        prefix = KIND_KEY[kind] + "."
        return {key[len(prefix):]: TensorInfo(tuple(meta.size), meta.properties.dtype)
                for key, meta in self.metadata.items() if key.startswith(prefix) and hasattr(meta, "size")}

    def components(self, kind: str) -> list[str]:
        return sorted({name.split(".", 1)[0] for name in self._entries(kind)})

    def infos(self, kind: str, component: str) -> dict[str, TensorInfo]:
        prefix = component + "."
        return {n[len(prefix):]: info for n, info in self._entries(kind).items() if n.startswith(prefix)}

    def read(self, kind: str, component: str, names: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        infos = self.infos(kind, component)
        wanted = {f"{component}.{n}": torch.empty(infos[n].shape, dtype=infos[n].dtype) for n in names}
        state = {KIND_KEY[kind]: wanted}
        dcp.load(state, checkpoint_id=str(self.checkpoint), no_dist=True)  # only these keys' chunks are read
        return {n: state[KIND_KEY[kind]][f"{component}.{n}"] for n in names}


def open_tensors(checkpoint: Path, backend: str) -> DpTensors | FsdpTensors:
    return FsdpTensors(checkpoint) if backend == "fsdp" else DpTensors(checkpoint)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def safetensors_dtype(name: str) -> torch.dtype:
    return _SAFETENSORS_DTYPES[name]
