"""The outputs of an op on meta tensors, computed once per distinct call (miles.replay.memory's mode
runs every op of a replay through it).

What a functional op makes from meta inputs depends on their shapes, strides and dtypes and on its
other arguments only, and torch computes it in Python for most ops: hundreds of microseconds a
call, most of a replay's time. A transformer's blocks repeat the same ops on the same shapes, so
each distinct call is computed once and its outputs' metadata reused.
"""

from __future__ import annotations

import functools

import torch

_META = torch.device("meta")
# in-place ops that fill a tensor (a module's initialization): no shape or storage changes
_INITIALIZERS = {"uniform_", "normal_", "zero_", "fill_", "copy_", "bernoulli_", "exponential_", "random_"}


class _MetaOutputs:
    """Each distinct call's outputs (shape, stride, dtype), made again on a repeat as fresh meta
    storages of the same layout; an in-place update accepted once is accepted again."""

    def __init__(self):
        self.outputs: dict = {}

    def run(self, func, args, kwargs):
        if _in_place(func):
            return self._run_in_place(func, args, kwargs)
        if not _functional(func):
            return func(*args, **kwargs)
        key = _call_key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        spec = self.outputs.get(key)
        if spec is not None:
            return _make(spec)
        out = func(*args, **kwargs)
        spec = _spec(out)
        if spec is not None:
            self.outputs[key] = spec
        return out

    def _run_in_place(self, func, args, kwargs):
        """An elementwise update of its first argument: on meta it only checks the arguments, and a
        call it has accepted once it accepts again; it changes no shape, stride or storage."""
        key = _call_key(func, args, kwargs)
        if key is not None and key in self.outputs:
            return args[0]
        out = func(*args, **kwargs)
        if key is not None and out is args[0]:
            self.outputs[key] = True
        return out


@functools.cache
def is_view(func) -> bool:
    """Whether an op only makes views of its inputs (its outputs alias them, nothing is written)."""
    schema = func._schema
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns) and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


@functools.cache
def _in_place(func) -> bool:
    """An elementwise (or initializing) update of its first argument, returned."""
    schema = func._schema
    name = schema.name.split("::")[-1]
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return (name.endswith("_") and not name.startswith("_") and len(schema.returns) == 1
            and len(writes) == 1 and writes[0] is schema.arguments[0]
            and (torch.Tag.pointwise in func.tags or name in _INITIALIZERS))


@functools.cache
def _functional(func) -> bool:
    """Fresh tensors out, no argument aliased or written."""
    schema = func._schema
    return bool(schema.returns) and all(r.alias_info is None and str(r.type) in ("Tensor", "Tensor[]")
                                        for r in schema.returns) and not any(
        a.alias_info is not None for a in schema.arguments)


class _Uncacheable(Exception):
    """An argument the cache cannot key on (a real or subclass tensor, an object)."""


def _call_key(func, args, kwargs):
    """A hashable description of the call, or None when an argument is not a meta tensor or a plain
    value (or a list of them), or no argument is a meta tensor (a factory: cheap already)."""
    key: list = [func, tuple(kwargs)]
    tensors = 0
    try:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor):
                key.append(_tensor_key(v))
                tensors += 1
            elif isinstance(v, (list, tuple)):
                if all(type(x) is int for x in v):  # a size: most lists an op takes
                    key.append((type(v), tuple(v)))
                    continue
                items = tuple(_tensor_key(x) if isinstance(x, torch.Tensor) else _plain_key(x) for x in v)
                tensors += sum(isinstance(x, torch.Tensor) for x in v)
                key.append((type(v), items))
            else:
                key.append(_plain_key(v))
    except _Uncacheable:
        return None
    return tuple(key) if tensors else None


_PLAIN = {int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout}


def _tensor_key(v: torch.Tensor):
    if type(v) is not torch.Tensor and type(v) is not torch.nn.Parameter or v.device.type != "meta":
        raise _Uncacheable
    return (v.shape, v.stride(), v.storage_offset(), v.dtype)


def _plain_key(v):
    if type(v) not in _PLAIN:
        raise _Uncacheable
    return (type(v), v)  # 1, 1.0 and True hash alike


def _spec(out):
    """(shape, stride, dtype) of each output, or None when they are not fresh, separate meta storages."""
    many = isinstance(out, (list, tuple))
    specs = []
    for t in (out if many else (out,)):
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or t.device.type != "meta":
            return None
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != _extent(t) * t.element_size():
            return None
        specs.append((tuple(t.shape), t.stride(), t.dtype))
    if many and len({id(t.untyped_storage()) for t in out}) != len(out):
        return None
    return (type(out) if many else None, tuple(specs))


def _extent(t: torch.Tensor) -> int:
    if any(n == 0 for n in t.shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _make(spec):
    kind, specs = spec
    made = [torch.ops.aten.empty_strided.default(shape, stride, dtype=dtype, device=_META)
            for shape, stride, dtype in specs]
    return made[0] if kind is None else kind(made)


META_OUTPUTS = _MetaOutputs()
