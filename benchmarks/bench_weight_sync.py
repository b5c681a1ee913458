"""Full-weight sync, object store vs bucketed broadcast vs IPC: time, GB/s and peak extra memory, in one run.

    python3 benchmarks/bench_weight_sync.py [--blocks 2] [--buffer-mib 64] [--rounds 2]

The model is our sd3 `proxy` transformer (the checkpoint `miles.proxy_assets.checkpoint --size
proxy` writes, built here from the same spec and seed, nothing downloaded) cut to `--blocks`
transformer blocks so it fits a shared CPU box (2 blocks: ~180 M parameters, ~0.7 GB in fp32).
One Ray actor plays train rank 0, one the engine, both on this machine's own private Ray cluster.

  object store: the sender copies every parameter to host memory and `ray.put`s the state dict
                (miles.backends.weight_sync), the engine fetches it and copies it in place;
  bucketed:     the two form a gloo group (miles.backends.sync_group) and the weights cross in
                buckets of --buffer-mib (the flag's default is 512 MiB; a smaller one here so the
                model takes several buckets on this CPU proxy).
  ipc:          the colocated path (miles.backends.ipc_push): the sender packs each bucket into one
                reused buffer the engine has opened from its handle (named shared memory on the
                CPU, CUDA IPC on a GPU) and copies out in place; one Ray call per bucket is the ack.

Time: the driver's wall clock from the first call to the last answer. Peak extra memory: each
actor samples its own resident set size (/proc/self/statm, shared object-store pages it touches
included) every 2 ms in a thread while it syncs; extra = peak - RSS just before; the row sums the
sender's and the engine's. The bucketed rows also give the staging bytes the packer counted (the
exact size of its live buffers). After each sync the engine's weights are checked bit-equal to the
sender's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import tempfile
import threading
import time
import zlib

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
COMPONENT = "transformer"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measured(fn):
    """(result, peak RSS - RSS before) of fn(), sampling RSS every 2 ms."""
    gc.collect()
    before, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    return result, max(peak[0], rss_bytes()) - before


def build_transformer(blocks: int, seed: int):
    from miles.proxy_assets.checkpoint import build_component
    from miles.models.registry import get_family

    spec = get_family("sd3").module.components("proxy")[COMPONENT]
    return build_component(dataclasses.replace(spec, config={**spec.config, "num_layers": blocks}), seed)


def checksum(module) -> int:
    crc = 0
    for _, p in module.named_parameters():
        crc = zlib.crc32(p.detach().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


class Side:
    """One end of the sync: the sender (train rank 0) or the engine."""

    def __init__(self, blocks: int, seed: int):
        torch.set_num_threads(1)
        self.module = build_transformer(blocks, seed).requires_grad_(False)
        self.numel = sum(p.numel() for p in self.module.parameters())

    def perturb(self, seed: int) -> int:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.module.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 1e-3)
        return checksum(self.module)

    def checksum(self) -> int:
        return checksum(self.module)

    def size(self) -> tuple[int, int]:
        return self.numel, sum(p.numel() * p.element_size() for p in self.module.parameters())

    # object store
    def put_state(self):
        import ray

        from miles.backends.weight_sync import collect_weight_updates

        def put():
            (update,) = collect_weight_updates({COMPONENT: self.module}, [COMPONENT], lora_only=False)
            return ray.put(update.state_dict)

        return measured(put)

    def load_state(self, boxed_ref: list) -> int:
        import ray

        from miles.backends.weight_sync import apply_weight_update

        def load():
            state = ray.get(boxed_ref[0])
            apply_weight_update(self.module, state)

        return measured(load)[1]

    # bucketed
    def free_port(self) -> int:
        from miles.utils.ports import free_ports

        return free_ports(1)[0]

    def plan(self, buffer_bytes: int):
        from miles.backends.weight_buckets import plan_buckets
        from miles.backends.weight_sync import synced_tensors

        return plan_buckets(synced_tensors({COMPONENT: self.module}, [COMPONENT], False), torch.float32, buffer_bytes)

    def join(self, address, rank: int, plan) -> None:
        from miles.backends.sync_group import WeightReceiver, WeightSender

        self.end = WeightSender(address, plan) if rank == 0 else WeightReceiver(address, rank, plan, {COMPONENT: self.module})

    def send(self) -> tuple[int, int]:
        tensors = {(COMPONENT, n): p for n, p in self.module.named_parameters()}
        staging, extra = measured(lambda: self.end.send(tensors))
        return extra, staging.peak

    def receive(self) -> tuple[int, int]:
        staging, extra = measured(self.end.receive)
        return extra, staging.peak

    # ipc
    def ipc_share(self, plan) -> bytes:
        from miles.backends.ipc_push import IpcSender

        self.ipc = IpcSender(plan, torch.device("cpu"))
        return self.ipc.handle

    def ipc_open(self, handle: bytes, plan) -> None:
        from miles.backends.ipc_push import IpcReceiver

        self.ipc = IpcReceiver(handle, plan, {COMPONENT: self.module})

    def ipc_send(self, boxed_engine: list) -> tuple[int, int]:
        import ray

        engine = boxed_engine[0]
        tensors = {(COMPONENT, n): p for n, p in self.module.named_parameters()}
        ray.get(engine.ipc_begin.remote())
        staging, extra = measured(lambda: self.ipc.send(tensors, lambda i: ray.get(engine.ipc_receive.remote(i))))
        return extra, staging.peak

    def ipc_begin(self) -> None:
        self.ipc.begin()

    def ipc_receive(self, index: int) -> None:
        self.ipc.receive(index)


def object_store_round(sender, engine) -> tuple[float, int]:
    import ray

    start = time.perf_counter()
    ref, sent_extra = ray.get(sender.put_state.remote())
    engine_extra = ray.get(engine.load_state.remote([ref]))
    elapsed = time.perf_counter() - start
    del ref
    return elapsed, sent_extra + engine_extra


def bucketed_round(sender, engine) -> tuple[float, int, int]:
    import ray

    start = time.perf_counter()
    (sent_extra, sent_staged), (engine_extra, engine_staged) = ray.get([sender.send.remote(), engine.receive.remote()])
    return time.perf_counter() - start, sent_extra + engine_extra, sent_staged + engine_staged


def ipc_round(sender, engine) -> tuple[float, int, int]:
    import ray

    start = time.perf_counter()
    extra, staged = ray.get(sender.ipc_send.remote([engine]))
    return time.perf_counter() - start, extra, staged


def connect(sender, engine, buffer_bytes: int):
    import ray

    from miles.backends.sync_group import SyncGroupAddress

    address = SyncGroupAddress("127.0.0.1", ray.get(sender.free_port.remote()), 2, "gloo", 600.0)
    plan = ray.get(sender.plan.remote(buffer_bytes))
    ray.get([sender.join.remote(address, 0, plan), engine.join.remote(address, 1, plan)])
    ray.get(engine.ipc_open.remote(ray.get(sender.ipc_share.remote(plan)), plan))
    return plan


def run(args) -> list[str]:
    import ray

    remote = ray.remote(num_cpus=1)(Side)
    sender, engine = remote.remote(args.blocks, 0), remote.remote(args.blocks, 0)
    numel, nbytes = ray.get(sender.size.remote())
    plan = connect(sender, engine, args.buffer_mib * 2**20)
    rows = {"object store": [], "bucketed": [], "ipc": []}
    staged = []
    for round_index in range(args.rounds):
        for path in rows:
            expected = ray.get(sender.perturb.remote(1 + sum(len(r) for r in rows.values())))
            if path == "object store":
                rows[path].append(object_store_round(sender, engine))
            else:
                elapsed, extra, staging = (bucketed_round if path == "bucketed" else ipc_round)(sender, engine)
                rows[path].append((elapsed, extra))
                if path == "bucketed":
                    staged.append(staging)
            assert ray.get(engine.checksum.remote()) == expected, f"{path}: the engine's weights differ"
    return report(args, numel, nbytes, plan, rows, staged)


def report(args, numel, nbytes, plan, rows, staged) -> list[str]:
    mib = 2**20
    medians = {path: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
               for path, runs in rows.items()}
    lines = [f"model: sd3 proxy transformer, {args.blocks} blocks, {numel / 1e6:.1f} M parameters, "
             f"{nbytes / mib:.0f} MiB fp32; {len(plan.buckets)} buckets of <= {args.buffer_mib} MiB "
             f"(largest {max(b.nbytes for b in plan.buckets) / mib:.1f} MiB); median of {args.rounds} rounds",
             "peak extra memory: RSS sampled every 2 ms in each actor during the sync, peak - before, "
             "sender + engine summed",
             f"{'path':<14}{'time s':>10}{'push GB/s':>11}{'extra MiB':>12}",
             *[f"{path:<14}{t:>10.3f}{nbytes / t / 1e9:>11.2f}{m / mib:>12.1f}" for path, (t, m) in medians.items()]]
    (t_os, m_os), (t_b, m_b), (t_i, m_i) = medians["object store"], medians["bucketed"], medians["ipc"]
    lines.append(f"{'ratio os/bkt':<14}{t_os / t_b:>10.2f}{'':>11}{m_os / max(m_b, 1):>12.2f}")
    lines.append(f"{'ratio bkt/ipc':<14}{t_b / t_i:>10.2f}{'':>11}{m_b / max(m_i, 1):>12.2f}")
    lines.append(f"bucketed staging counted by the packer (sender + engine): {max(staged) / mib:.1f} MiB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks of the proxy sd3 model")
    parser.add_argument("--buffer-mib", type=int, default=64, help="bucket size of the bucketed path")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=3 * 2**30, _temp_dir=tempfile.mkdtemp(prefix="bws", dir="/tmp"))
    try:
        print("\n".join(run(args)), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
