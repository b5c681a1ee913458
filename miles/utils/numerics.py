"""Pinned CPU numerics: the same code and the same locked packages give the same bits on any
x86-64 CPU with AVX2.

Left alone, the numerical libraries pick their code path from the processor they find: torch's
vectorised kernels dispatch to AVX-512 where it exists, MKL chooses its GEMM kernels and
blocking per CPU model, oneDNN (convolutions, bf16 matmuls) per ISA, numpy's SIMD loops (exp,
log, ...) per feature level, and every threaded reduction splits its work by the thread count,
which defaults to the number of cores. Each choice can move the last bits of a forward, and a
rollout multiplies those bits into different samples. So every process a CPU run (`--device
cpu`) starts gets the environment below, set where the run starts (the launcher's `ray start`
and job runtime env, the recipe process, `train_diffusion.py` itself) rather than in anyone's
shell, and overriding whatever the shell says: AVX2 is the common level of every machine the
standards are meant for. A GPU run computes on its GPUs and gets none of it: its job env carries
only the documented host thread count (`GPU_JOB_ENV`), and the pins a recipe process or a pinned
shell holds are dropped before its cluster and job start (`unpinned_environ`).

Nothing here imports torch: `pin_this_process()` has to run before torch (and its OpenMP
runtime, which reads the thread count once when it loads) is imported.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata

# Every thread count is 1: reductions then never depend on how many cores a machine has, and on
# the CPU tier each engine, train rank and reward worker is its own process, so one thread each
# is also what fits the cores (measured cost in benchmarks/bench_numerics_pinning.py).
PINNED_THREADS = 1

# A GPU rank or engine computes on its GPU; its host work (the SDE step on the host, decoding
# frames for the reward, data) runs on this many torch threads, whatever OMP_NUM_THREADS the CPU
# pins above gave the job: one thread there starves it. A fixed count, not the core count, so the
# host's reductions split the same way on every node (engines and ranks use the same count).
GPU_PROCESS_CPU_THREADS = 4

PINNED_ENV: dict[str, str] = {
    # torch's own vectorised kernels (ATen): the AVX2 build even where AVX-512 exists
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL's conditional numerical reproducibility: one code path and reduction order on every CPU
    "MKL_CBWR": "AVX2,STRICT",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "MKL_DYNAMIC": "FALSE",
    # oneDNN: convolutions and reduced-precision matmuls (both spellings of the variable)
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    # numpy's runtime-dispatched SIMD loops: no AVX-512 variants (both numpy 1.x and 2.x names;
    # numpy ignores names it does not know)
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_SKX AVX512_CLX "
                                "AVX512_CNL AVX512_KNL AVX512_KNM",
    "OMP_NUM_THREADS": str(PINNED_THREADS),
    "MKL_NUM_THREADS": str(PINNED_THREADS),
}

# The processor features the pinned path needs. A CPU without them cannot reproduce the bits and
# shows up as a different fingerprint, not as a wrong number.
REQUIRED_CPU_FLAGS = ("avx2", "fma")

# Packages whose version can move a metric; their versions are part of the fingerprint and
# exact in constraints.txt (docs/testing.md, "The lock").
NUMERIC_PACKAGES = (
    "torch", "diffusers", "transformers", "peft", "accelerate", "safetensors", "numpy", "tokenizers",
    "pillow", "onnxruntime", "rapidocr-onnxruntime", "opencv-python", "ray",
)


# What a GPU job's processes get instead of the pins: the documented host thread count, for
# libraries that read it from the environment (OpenMP, MKL) before torch's own setting applies.
# No ISA levels: a GPU job's bits come from its GPU kernels, and its host work should run at the
# speed the host can give it.
GPU_JOB_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": str(GPU_PROCESS_CPU_THREADS),
    "MKL_NUM_THREADS": str(GPU_PROCESS_CPU_THREADS),
}


def pinned_env() -> dict[str, str]:
    return dict(PINNED_ENV)


def job_numerics_env(device: str) -> dict[str, str]:
    """The numerics variables a job on `device` gets in its runtime env: the CPU tier's pins for
    a CPU job (`--device cpu`), only the documented host thread count for a GPU job."""
    return pinned_env() if device == "cpu" else dict(GPU_JOB_ENV)


def pin_environ(environ: MutableMapping[str, str]) -> None:
    """Write the pinned settings into `environ` (an environment for a process about to start)."""
    environ.update(PINNED_ENV)


def unpinned_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the CPU tier's pins: every pinned name that holds its pinned value is
    dropped (a recipe process pins itself before it builds checkpoints, and the harness's own
    environment is pinned; a GPU job started from either must not inherit them). A value the
    user set to something else is theirs and stays."""
    return {k: v for k, v in environ.items() if PINNED_ENV.get(k) != v}


def pin_this_process() -> None:
    """Pin this process: must run before torch is imported here (the thread count and ISA level
    are read when the libraries load). If torch is already loaded, its thread count is still
    set; the kernel level then stays what it was, which the fingerprint will show."""
    pin_environ(os.environ)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(PINNED_THREADS)


def unpin_this_process() -> None:
    """A GPU run's process: the pins dropped from this environment (so the Ray workers it starts
    do not inherit them) and the documented host thread count set in their place."""
    kept = unpinned_environ(os.environ)
    for name in PINNED_ENV:
        if name not in kept:
            os.environ.pop(name, None)
    for name, value in GPU_JOB_ENV.items():
        os.environ.setdefault(name, value)


# -- the fingerprint -------------------------------------------------------------------------

def cpu_info() -> dict:
    """The CPU's vendor, model and SIMD flags, from /proc/cpuinfo (empty where there is none)."""
    vendor, model, flags = "", platform.processor() or "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "model name" and not model.startswith(value.strip()):
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    simd = sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4")))
    return {"vendor": vendor, "model": model, "machine": platform.machine(), "simd_flags": simd}


def package_versions(names: tuple[str, ...] = NUMERIC_PACKAGES) -> dict[str, str | None]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def numerics_settings(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The pinned variables as this process sees them."""
    environ = os.environ if environ is None else environ
    return {k: environ.get(k) for k in sorted(PINNED_ENV)}


def fingerprint(gpus: list[str] | None = None, driver: str | None = None, cuda: str | None = None) -> dict:
    """What decides a run's bits: compared between a run and its standard.

    The CPU model is deliberately not in it (see `machine_info`): with the numerics pinned, two
    AVX2 CPUs of one vendor must agree, and if they ever do not, that is a pinning bug to report,
    not an environment difference to excuse. The vendor is in it: MKL and oneDNN are Intel's, and
    MKL's reproducible AVX2 path (MKL_CBWR) is an Intel processor's; an AMD EPYC under the same
    pins and packages computed other bits (the tiny recipe's rollout-0 reward 0.5165 against the
    0.5304 its standard recorded on an Intel Xeon).
    """
    import torch  # the caller has pinned and imported torch by now

    cpu = cpu_info()
    flags = set(cpu["simd_flags"])
    return {
        "cpu_isa": "x86-64 " + "+".join(REQUIRED_CPU_FLAGS) if all(f in flags for f in REQUIRED_CPU_FLAGS)
        else f"{platform.machine()} without {'+'.join(f for f in REQUIRED_CPU_FLAGS if f not in flags)}",
        "cpu_vendor": cpu["vendor"] or None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "numerics": numerics_settings(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "gpus": list(gpus or []),
        "gpu_driver": driver,
        "cuda": cuda,
    }


def machine_info() -> dict:
    """Recorded beside the fingerprint for the reader; never compared."""
    return {"cpu": cpu_info(), "hostname": platform.node(), "kernel": platform.release()}


# -- naming what changed --------------------------------------------------------------------

_LABELS = {
    "cpu_isa": "CPU instruction set",
    "cpu_vendor": "CPU vendor",
    "torch_cpu_capability": "torch CPU capability",
    "torch_threads": "torch threads",
    "python": "python",
    "gpus": "GPUs",
    "gpu_driver": "GPU driver",
    "cuda": "CUDA",
}


def fingerprint_changes(recorded: Mapping | None, current: Mapping | None) -> list[str]:
    """`["torch CPU capability AVX512 -> AVX2", "transformers 5.23.0 -> 5.24.0", ...]`: what
    differs between a standard's fingerprint and a run's, in a fixed order; [] when equal."""
    if not recorded:
        return ["the standard records no fingerprint (recorded before fingerprints; re-record it)"]
    if not current:
        return ["the run recorded no fingerprint in run.json"]
    changes = []
    for key in ("cpu_isa", "cpu_vendor", "torch_cpu_capability", "torch_threads", "python", "gpus", "gpu_driver",
                "cuda"):
        if recorded.get(key) != current.get(key):
            changes.append(f"{_LABELS[key]} {_show(recorded.get(key))} -> {_show(current.get(key))}")
    for group, label in (("numerics", ""), ("packages", "")):
        old, new = recorded.get(group) or {}, current.get(group) or {}
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                changes.append(f"{label}{name} {_show(old.get(name))} -> {_show(new.get(name))}")
    return changes


def _show(value) -> str:
    if value is None or value == []:
        return "(none)"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)
