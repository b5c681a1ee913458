"""What the replay puts in place while the project's code runs on meta tensors, and why.

Each seam stands where the real run would touch a GPU, a file or a peer; everything else is the
project's own code. All are undone when the replay ends.

- what the real run builds on meta (`_empty_component`, `attach_lora_on_meta`) is charged nowhere;
- a fake process group of the recipe's world size (torch's `fake` backend: collectives return
  at once) and a CPU device mesh over it; FSDP2 is told not to refuse meta parameters (its
  check exists because real training needs values; the replay needs only shapes);
- `Collectives`, the ranks' group, is checked as on a GPU rank (`cpu:gloo,cuda:nccl`): a
  collective of a host tensor goes to gloo, of a GPU tensor to NCCL, anything else is refused;
- a meta storage's `data_ptr` is its own id (every meta storage reports 0, and the offload code
  tells storages apart by it), and resizing a storage in place (offload) is counted; a real host
  scalar (AdamW's step count) is not freed by an offload, since its host copy is on meta;
- the sharded setup's reading of each rank's rows from the safetensors files: the parameters
  get (meta) storage on the device and each weight's rows pass through the host one at a time;
- a component the loader builds is built on the host and moved to the role's device, as
  `from_pretrained` loads it and load_model moves it (`_named`);
- attention runs as the GPU's fused kernel (`_fused_attention`), not torch's math fallback;
- without torchvision (not a dependency), diffusers' Cosmos transformer gets a nearest resize;
- objects gathered from the ranks (`all_gather_object`) are rank 0's, as every rank is;
- the checkpoint writers (safetensors `save_file`, `torch.distributed.checkpoint.async_save`)
  write no file: they make the host copies the real writers make (safetensors: every tensor's
  bytes at once; DCP's asynchronous save: every local shard staged on the host at once), and
  the checkpoint's own gloo group is not made; a data-parallel rank's background write runs in
  the calling thread (the replay's dispatch mode is thread-local).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from miles.replay.memory import HOST, UNPLACED, LiveMemory


class ReplayCollectiveError(RuntimeError):
    """A collective the real run's process group would refuse (a tensor on the wrong device)."""


@contextmanager
def fake_process_group(world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the replay needs its own process group; this process already has one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _collectives_class(memory: LiveMemory):
    from miles.backends.collectives import Collectives, backend_for, supported_devices

    class ReplayCollectives(Collectives):
        """The rank's group as a GPU rank builds it; the tensor's place decides its device."""

        def __post_init__(self):
            self.backend = backend_for("cuda")
            self.supported = supported_devices(self.backend)

        def init_process_group(self, rank, master_addr, master_port, always=False, store=None):
            return None  # the fake group is already up

        def check(self, op: str, tensor: torch.Tensor) -> None:
            device = "cpu" if tensor.device.type == "cpu" or _place(memory, tensor) == HOST else "cuda"
            self.calls.append((op, self.backend, device))
            if device not in self.supported:
                raise ReplayCollectiveError(f"{op} of a {device} tensor on a {self.backend!r} group")

    return ReplayCollectives


def _place(memory: LiveMemory, tensor: torch.Tensor) -> str | None:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    alloc = memory.live.get(local.untyped_storage()._cdata)
    return None if alloc is None else alloc.place


def _materialize(memory: LiveMemory):
    @torch.no_grad()
    def materialize_from_checkpoint(module, folder, device, lora_values=None) -> int:
        """As miles.backends.sharded_load's: storage for this rank's rows, each weight's rows read
        through the host in turn (a host buffer of the rows, copied in, freed)."""
        from miles.backends.sharded_load import _local_rows

        memory.mark(f"{memory.role} reads its rows of {Path(folder).name}")
        buffers = {(id(sub), name): (sub, name, b.to(device)) for sub in module.modules()
                   for name, b in sub._buffers.items() if b is not None}
        module.to_empty(device=device)
        for sub, name, value in buffers.values():
            sub._buffers[name] = value
        read = 0
        for _, tensor in module.named_parameters():
            local, _ = _local_rows(tensor)
            with memory.at(HOST, memory.role):
                rows = torch.empty(local.shape, dtype=local.dtype, device="cpu")
            local.copy_(rows)
            read += rows.numel() * rows.element_size()
            del rows
        return read

    return materialize_from_checkpoint


def _save_file(tensors: dict, filename, metadata=None) -> None:
    """safetensors' save_file keeps every tensor's bytes at once before it writes."""
    staged = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cpu") for t in tensors.values()]
    del staged


def _dcp_async_save(state_dict, *, checkpoint_id=None, **kwargs):
    """DCP's asynchronous save stages every tensor's local shard on the host at once, then its
    thread writes them; the stand-in writes nothing and its write has ended when it returns."""
    import concurrent.futures

    from torch.utils._pytree import tree_leaves

    staged = [(t.to_local() if hasattr(t, "to_local") else t).detach().cpu()
              for t in tree_leaves(state_dict) if isinstance(t, torch.Tensor)]
    del staged
    done = concurrent.futures.Future()
    done.set_result(None)
    return done


def _run_here(work):
    """A background write run in the caller's thread: the replay's dispatch mode (thread-local)
    sees its copies, while the snapshot it writes is still held, as in the real thread."""
    import concurrent.futures

    done = concurrent.futures.Future()
    done.set_result(work())
    return done


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """Attention as a GPU runs it, fused (memory-efficient kernel: the output and one value per
    query row kept for backward, never the [queries, keys] matrix); on meta, torch's own math
    fallback would materialize that matrix, which no GPU run holds."""
    if query.device.type != "meta" or query.dim() != 4:
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: every query head reads its key head
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    bias = None
    if attn_mask is not None:
        bias = attn_mask.to(query.dtype) if attn_mask.dtype != torch.bool else torch.zeros(
            attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~attn_mask, float("-inf"))
        bias = bias.expand(*query.shape[:-1], key.shape[-2])
    grad = query.requires_grad or key.requires_grad or value.requires_grad
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p, is_causal,
                                                                  scale=scale)[0]


class _NearestResize:
    """torchvision's `transforms` as diffusers' Cosmos transformer uses it (its padding mask, resized
    nearest): torchvision is not among this project's dependencies, so without it that forward
    stops at a NameError; the replay runs it with torch's own nearest interpolation."""

    class InterpolationMode:
        NEAREST = "nearest"

    class functional:  # noqa: N801 - torchvision's name
        @staticmethod
        def resize(tensor, size, interpolation="nearest"):
            return torch.nn.functional.interpolate(tensor, size=list(size), mode="nearest")


def _all_gather_object(object_list: list, obj, group=None) -> None:
    """Every rank is replayed as rank 0: each one's object is this rank's (pickled objects cannot
    ride a meta tensor)."""
    object_list[:] = [obj] * len(object_list)


def _unplaced(memory: LiveMemory, fn, mark: bool = False):
    """`fn` as the real run runs it on the meta device: what it makes holds no bytes. `mark`: its
    call starts a segment of the phase (a component's build, its name the first argument)."""
    def wrapped(*args, **kwargs):
        if mark:
            memory.mark(f"{memory.role} builds {args[0]}")
        with memory.at(UNPLACED, memory.role):
            return fn(*args, **kwargs)

    return wrapped


def _moved_to_device(memory: LiveMemory):
    """`Tensor.to` as on a GPU: a host tensor asked onto the device is copied there. On meta the
    two are one device, so torch hands back the same tensor; this makes the copy, on the role's GPU."""
    to = torch.Tensor.to

    def moved(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if out is not self or type(self) not in (torch.Tensor, torch.nn.Parameter) or self.device.type != "meta":
            return out
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or device.type != "meta" or memory.place in (HOST, UNPLACED):
            return out
        if memory.place_of(self) != HOST:
            return out
        with memory.forcing(memory.place):
            return self.clone()

    return moved


def _marked_step(memory: LiveMemory, step):
    """`TrainRank._optimizer_step`, starting a segment of the train phase: the backward's peak
    (activations) and the step's (AdamW's state, the gradients) grow by different amounts a block,
    so the one that is the larger can change between the replayed depths and the released one
    (LTX-2.3 full: the backward at 4 and 5 blocks, the step at 48)."""
    def wrapped(self, *args, **kwargs):
        memory.mark(f"{memory.role} optimizer step")
        return step(self, *args, **kwargs)

    return wrapped


def _named(memory: LiveMemory, build):
    """The loader's meta build of a component, as `from_pretrained` loads it: on the host, then moved
    to the role's device (load_model moves each part as soon as it is loaded), its tensors named as
    they land (so a refusal can name tensors a phase drops before it ends)."""
    def wrapped(name, *args, **kwargs):
        memory.mark(f"{memory.role} builds {name}")
        place = memory.place
        if place in (HOST, UNPLACED):
            module = build(name, *args, **kwargs)
        else:
            with memory.at(HOST, memory.role):
                module = build(name, *args, **kwargs)
            if isinstance(module, torch.nn.Module):
                module.to(device=torch.device("meta"))  # the seam below copies it to the device, freeing the host's
        if isinstance(module, torch.nn.Module):
            memory.name_storages({f"{memory.role} {name}.{n}": t for n, t in
                                  [*module.named_parameters(), *module.named_buffers()]})
        return module

    return wrapped


@contextmanager
def replay_seams(memory: LiveMemory):
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from miles.backends.actor import TrainRank
    from miles.backends.sharded_load import attach_lora_on_meta
    from miles.models.loader import _empty_component, _meta_component

    data_ptr, resize = torch.UntypedStorage.data_ptr, torch.UntypedStorage.resize_

    def meta_data_ptr(self):
        return self._cdata if self.device.type == "meta" else data_ptr(self)

    def counted_resize(self, size):
        if self.device.type == "cpu" and size == 0:
            return self  # a real host scalar (AdamW's step) offloaded: kept, as its copy on meta holds no value
        out = resize(self, size)
        if self.device.type == "meta":
            memory.resized(self)
        return out

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # made before the meta mode is on

    def cpu_mesh(device, world_size, replicas=1):
        if replicas != 1:  # the replay's mesh is made before the meta mode, one dimension
            raise NotImplementedError(f"the replay shards over one mesh dimension; --dp-replicate-size {replicas} "
                                      f"(HSDP) is not replayed")
        return mesh

    with ExitStack() as stack:
        for target, value in [
            ("torch.UntypedStorage.data_ptr", meta_data_ptr),
            ("torch.Tensor.to", _moved_to_device(memory)),
            ("torch.UntypedStorage.resize_", counted_resize),
            ("torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._validate_no_meta_params",
             lambda self: None),
            ("miles.backends.actor.Collectives", _collectives_class(memory)),
            ("miles.backends.fsdp.device_mesh", cpu_mesh),
            ("miles.backends.sharded_load.materialize_from_checkpoint", _materialize(memory)),
            ("miles.backends.checkpoint.save_file", _save_file),
            ("torch.distributed.checkpoint.async_save", _dcp_async_save),
            ("miles.backends.checkpoint_writer.new_checkpoint_group", lambda: None),
            ("miles.backends.checkpoint_writer._run_in_thread", _run_here),
            ("torch.distributed.all_gather_object", _all_gather_object),
            ("torch.nn.functional.scaled_dot_product_attention", _fused_attention),
            ("miles.models.loader._empty_component", _unplaced(memory, _empty_component, mark=True)),
            ("miles.models.loader._meta_component", _named(memory, _meta_component)),
            ("miles.backends.sharded_load.attach_lora_on_meta", _unplaced(memory, attach_lora_on_meta)),
            ("miles.backends.actor.TrainRank._optimizer_step", _marked_step(memory, TrainRank._optimizer_step)),
        ]:
            stack.enter_context(mock.patch(target, value))
        assert _fsdp_param_group is not None
        import diffusers.models.transformers.transformer_cosmos as cosmos

        if not hasattr(cosmos, "transforms"):
            stack.enter_context(mock.patch.object(cosmos, "transforms", _NearestResize, create=True))
        yield


@contextmanager
def sft_stand_ins(conditioning):
    """SFT's step without its dataset's files: each item's media is a host tensor of its pixels'
    shape (`load_pixels` reads a PNG), and a prompt's conditioning the shapes the family's
    `encode` returns, on the host where `SFTRankStep` caches it (a config checkpoint has no
    tokenizer; the text encoder's no-grad forward over one prompt is not replayed)."""
    def pixels(item, is_video: bool) -> torch.Tensor:
        shape = (item.frames, 3, item.height, item.width) if is_video else (3, item.height, item.width)
        return torch.empty(shape, dtype=torch.float32, device="cpu")

    def cond(self, prompt: str):
        return conditioning().to("cpu")

    with mock.patch("miles.backends.sft.load_pixels", pixels), \
            mock.patch("miles.backends.sft.SFTRankStep._cond", cond):
        yield


def staging_dir(root: Path) -> Path:
    path = root / "staging"
    path.mkdir(parents=True, exist_ok=True)
    return path
