import subprocess
import sys
import textwrap
import time

import pytest

from miles.testing.leases import GpuInfo, NoNvml, NotEnoughGpus, lease_gpus, lock_path, probe_gpus, try_lease, visible_pool


def gpus(n, **busy):
    return [GpuInfo(str(i), i, f"GPU-{i:04d}", "Fake", **(busy.get(str(i)) or {})) for i in range(n)]


def test_leases_free_gpus_and_names_them_for_cuda_visible_devices(tmp_path):
    with try_lease(2, gpus(4), lock_dir=tmp_path) as lease:
        assert lease.devices == "0,1"


def test_busy_gpus_are_skipped():
    pool = gpus(3, **{"0": {"compute_pids": (123,)}, "1": {"memory_used_mib": 9000.0}})
    with try_lease(1, pool, lock_dir="/tmp/miles-test-locks-unused") as lease:
        assert lease.devices == "2"


def test_too_few_free_gpus_raise_needs_n_found_m(tmp_path):
    pool = gpus(2, **{"0": {"compute_pids": (1,)}})
    with pytest.raises(NotEnoughGpus, match="needs 2 GPUs, found 1 free"):
        try_lease(2, pool, lock_dir=tmp_path)


def test_a_lease_is_exclusive_within_a_process(tmp_path):
    with try_lease(2, gpus(3), lock_dir=tmp_path):
        with pytest.raises(NotEnoughGpus, match="found 1 free"):
            try_lease(2, gpus(3), lock_dir=tmp_path)
        with try_lease(1, gpus(3), lock_dir=tmp_path) as other:
            assert other.devices == "2"
    with try_lease(3, gpus(3), lock_dir=tmp_path):
        pass


HOLDER = textwrap.dedent('''
    import sys, time
    from miles.testing.leases import GpuInfo, try_lease
    lease = try_lease(1, [GpuInfo("0", 0, "GPU-0000")], lock_dir=sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
''')


def test_another_process_respects_the_lease_and_the_os_frees_it_when_the_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(NotEnoughGpus, match="1 leased by other tests"):
            try_lease(1, gpus(1), lock_dir=tmp_path)
    finally:
        holder.kill()  # no cleanup code runs: only the kernel can drop the lock
        holder.wait()
    with try_lease(1, gpus(1), lock_dir=tmp_path) as lease:
        assert lease.devices == "0"
    assert lock_path(tmp_path, gpus(1)[0]).exists()


def test_lease_waits_for_gpus_held_by_others_then_gives_up(tmp_path):
    clock = iter(range(0, 1000, 5))
    with try_lease(1, gpus(1), lock_dir=tmp_path):
        with pytest.raises(NotEnoughGpus):
            lease_gpus(1, lock_dir=tmp_path, wait=12, poll=0, probe=lambda pool: gpus(1), pool=None,
                       clock=lambda: next(clock), sleep=lambda s: None)


def test_a_pool_smaller_than_needed_fails_at_once(tmp_path):
    with pytest.raises(NotEnoughGpus, match="needs 4 GPUs, found 2 free"):
        lease_gpus(4, lock_dir=tmp_path, wait=3600, probe=lambda pool: gpus(2), pool=None,
                   sleep=lambda s: pytest.fail("must not wait"))


def test_cuda_visible_devices_is_the_pool():
    assert visible_pool({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_pool({}) is None
    assert visible_pool({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_probe_without_nvml_says_so():
    try:
        probe_gpus()
    except NoNvml as e:
        assert "NVML" in str(e) or "pynvml" in str(e)
    else:
        pytest.skip("NVML works on this machine")


def test_a_shared_lease_takes_a_busy_gpu_another_lease_holds(tmp_path):
    """ci/run_suite.py --gpu-shares places several cases on one GPU: each case's lease must get it
    although the others hold its lock and run on it."""
    busy = gpus(1, **{"0": {"compute_pids": (123,), "memory_used_mib": 20000.0}})
    with try_lease(1, gpus(1), lock_dir=tmp_path):
        with pytest.raises(NotEnoughGpus):
            try_lease(1, busy, lock_dir=tmp_path)
        with try_lease(1, busy, lock_dir=tmp_path, shared=True) as first, \
                try_lease(1, busy, lock_dir=tmp_path, shared=True) as second:
            assert first.devices == second.devices == "0"
    with pytest.raises(NotEnoughGpus, match="the shared pool has only 1"):
        try_lease(2, busy, lock_dir=tmp_path, shared=True)
