"""A fully fine-tuned transformer as a diffusers model folder.

    <out>/<component>/config.json                                     the base's, unchanged
    <out>/<component>/diffusion_pytorch_model-0000i-of-0000n.safetensors
    <out>/<component>/diffusion_pytorch_model.safetensors.index.json  weight_map + total_size

Every tensor of the base's state dict is written: the trained ones from the checkpoint, the rest
(buffers, anything not trained) from the base. Tensors go to shards in name order, a new shard
when the next tensor would take it past --max-shard-size; each shard is read, written and
dropped before the next, so memory holds one shard set. The bytes depend only on the tensors'
names, dtypes and values: an fsdp checkpoint and a data-parallel one of the same weights export
to the same files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from miles.export.errors import ExportError
from miles.export.tensors import TensorInfo, safetensors_dtype

WEIGHTS_NAME = "diffusion_pytorch_model"
INDEX_NAME = f"{WEIGHTS_NAME}.safetensors.index.json"
CONFIG_NAME = "config.json"


class BaseWeights:
    """The base component's tensors by name, read one file at a time (single or sharded layout)."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX_NAME
        if index.is_file():
            self.files = {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        elif (single := folder / f"{WEIGHTS_NAME}.safetensors").is_file():
            self.files = dict.fromkeys(_keys(single), single)
        else:
            raise ExportError(f"the base's {folder} has no {WEIGHTS_NAME}.safetensors (nor an index); "
                              f"the export needs the base's weights in safetensors")

    def infos(self) -> dict[str, TensorInfo]:
        from safetensors import safe_open

        out = {}
        for path in sorted(set(self.files.values())):
            with safe_open(str(path), framework="pt") as f:
                for n in f.keys():
                    s = f.get_slice(n)
                    out[n] = TensorInfo(tuple(s.get_shape()), safetensors_dtype(s.get_dtype()))
        return out

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        for path in sorted({self.files[n] for n in names}):
            with safe_open(str(path), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in names if self.files[n] == path})
        return out


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def plan_shards(infos: dict[str, TensorInfo], max_shard_bytes: int) -> list[list[str]]:
    """Names in sorted order cut into shards of at most max_shard_bytes (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(infos):
        nbytes = infos[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_transformer(out: Path, base_folder: Path, component: str, reader, kind: str, max_shard_bytes: int) -> Path:
    """Write `<out>/<component>`: the base's config and every tensor, trained ones from `reader`."""
    from safetensors.torch import save_file

    base = BaseWeights(base_folder)
    base_infos, trained = base.infos(), reader.infos(kind, component)
    _check_same_layout(component, base_infos, trained)
    infos = {**base_infos, **trained}
    folder = out / component
    folder.mkdir(parents=True)
    shutil.copyfile(base_folder / CONFIG_NAME, folder / CONFIG_NAME)
    shards = plan_shards(infos, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"{WEIGHTS_NAME}-{i:05d}-of-{len(shards):05d}.safetensors"
        from_ckpt = [n for n in names if n in trained]
        tensors = {**base.read([n for n in names if n not in trained]), **reader.read(kind, component, from_ckpt)}
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": sum(i.nbytes for i in infos.values())}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def _check_same_layout(component: str, base: dict[str, TensorInfo], trained: dict[str, TensorInfo]) -> None:
    unknown = sorted(set(trained) - set(base))
    if unknown:
        raise ExportError(f"the checkpoint's {component} has tensors the base's lacks ({unknown[0]}, ... "
                          f"{len(unknown)} in all): it was not trained from this base; export it with its own base")
    wrong = [n for n in trained if trained[n].shape != base[n].shape]
    if wrong:
        raise ExportError(f"the checkpoint's {component}.{wrong[0]} has shape {list(trained[wrong[0]].shape)}, the "
                          f"base's {list(base[wrong[0]].shape)}: it was not trained from this base")
