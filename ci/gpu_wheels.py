#!/usr/bin/env python3
"""The wheelhouse for the GPU check on a machine without a package index (ci/gpu_wheels.sh DIR).

Downloads, for the GPU image's Python (3.12, manylinux x86-64), the wheels of what the check
imports that the image lacks: the project's dependencies and the harness's, then theirs, walking
each wheel's Requires-Dist, minus what the image holds (ci/gpu_image_packages.txt, from the
device machine's package list) and minus what the check never imports (SKIP, with the reason).
Versions are the ones installed here when they are (the CPU tier's versions), else the newest
that fits. Ray's wheel is slimmed (its Java jars and the dashboard's source map: 32 MB of 79) so
that the wheelhouse and the repository travel together under the device's 64 MiB limit.

    python3 ci/gpu_wheels.py DIR [--limit-mib N]
"""

from __future__ import annotations

import argparse
import hashlib
import base64
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "ci" / "gpu_image_packages.txt"
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# what travels to the device: the repository's files and the carried wheelhouse together
TRANSFER_LIMIT_MIB = 64.0
MARGIN_MIB = 1.0  # untracked files that travel too (a log, a plan), and the repository's growth
# what the requirements name but the check never imports
SKIP = {
    "wandb": "the check logs to no W&B run (WANDB_API_KEY is never set there)",
    "check-jsonschema": "only the workflow-schema unit test uses it, and that runs on the CPU",
    "rapidocr-onnxruntime": "the OCR reward of the sd3_ocr recipe, which is not among the check's cases "
                            "(miles/rollout/rm_hub/ocr.py imports it when called)",
    "py-spy": "ray[default]: the dashboard's stack dumps, which nobody asks for in the check",
    "virtualenv": "ray[default]: runtime_env pip/uv environments, which the recipes do not use",
    "smart-open": "ray[default]: remote runtime_env URIs, which the recipes do not use",
}
# the check's requirements beyond pyproject's (the harness's test extra, narrowed by SKIP)
EXTRAS = ("test",)
# members of Ray's wheel the check never loads: the Java worker's jars, the dashboard's 6 MB source
# map and RLlib (a library on top of Ray that nothing in Ray itself imports)
RAY_DROPPED = ("ray/jars/", ".js.map", "ray/rllib/")


def image_packages() -> set[str]:
    lines = IMAGE_LIST.read_text().splitlines()
    return {canonicalize_name(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def roots() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in EXTRAS:
        names += project["optional-dependencies"][extra]
    return [Requirement(n) for n in names]


def target_environment(extra: str = "") -> dict[str, str]:
    env = default_environment()
    env.update(python_version=PYTHON, python_full_version=f"{PYTHON}.3", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython", extra=extra)
    return env


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target_environment(e)) for e in (extras or {""}))


def pinned(req: Requirement) -> str:
    """name==the version installed here when it satisfies the requirement, else the requirement."""
    try:
        here = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return f"{req.name}{req.specifier}"
    return f"{req.name}=={here}" if req.specifier.contains(here, prereleases=True) else f"{req.name}{req.specifier}"


def download(spec: str, out: Path) -> Path:
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON, "--implementation", "cp", "-d", str(out), spec]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)
    new = set(out.glob("*.whl")) - before
    name = canonicalize_name(Requirement(spec).name)
    matches = [w for w in (new or out.glob("*.whl")) if parse_wheel_filename(w.name)[0] == name]
    if not matches:
        raise SystemExit(f"pip downloaded no wheel of {spec}")
    return matches[0]


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def resolve(out: Path) -> list[Path]:
    """Every wheel the roots need that the image lacks, walked breadth first."""
    have, skipped = image_packages(), set(SKIP)
    queue = [(r, set(r.extras)) for r in roots()]
    fetched: dict[str, Path] = {}
    walked: dict[str, set[str]] = {}  # the extras each wheel's requirements were walked with
    while queue:
        req, extras = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in have or name in skipped:
            continue
        if name not in fetched:
            fetched[name] = download(pinned(req), out)
            print(f"  {fetched[name].name} ({fetched[name].stat().st_size / 2**20:.1f} MiB)", flush=True)
        elif extras <= walked[name]:
            continue
        walked[name] = walked.get(name, set()) | extras
        for dep in requires(fetched[name]):
            if applies(dep, extras):
                queue.append((dep, set(dep.extras)))
    return list(fetched.values())


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(wheel: Path, dropped: tuple[str, ...]) -> int:
    """Rewrites the wheel without the members matching `dropped` (and their RECORD lines);
    returns the bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        def drop(n: str) -> bool:
            return any(n.startswith(d) or n.endswith(d) for d in dropped)

        for info in src.infolist():
            if drop(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not drop(line.split(",", 1)[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def default_limit_mib() -> float:
    """The transfer limit less the repository's tracked files and a margin."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tracked = sum((REPO / f).stat().st_size for f in files.decode().split("\0") if f and (REPO / f).is_file())
    return TRANSFER_LIMIT_MIB - tracked / 2**20 - MARGIN_MIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="the wheelhouse (created; its wheels are replaced)")
    p.add_argument("--limit-mib", type=float,
                   help="fail when the wheels together are larger (default: 64 MiB, what the device "
                        "takes, less the repository's files and 1 MiB)")
    args = p.parse_args(argv)
    limit = args.limit_mib if args.limit_mib is not None else default_limit_mib()
    args.dir.mkdir(parents=True, exist_ok=True)
    for old in args.dir.glob("*.whl"):
        old.unlink()
    print(f"wheels for Python {PYTHON} the GPU image lacks ({IMAGE_LIST.name}):")
    wheels = resolve(args.dir)
    for wheel in wheels:
        if parse_wheel_filename(wheel.name)[0] == "ray":
            print(f"  slimmed {wheel.name}: -{slim(wheel, RAY_DROPPED) / 2**20:.1f} MiB "
                  f"(without {', '.join(RAY_DROPPED)})")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {total:.1f} MiB in {args.dir}")
    print(f"limit {limit:.1f} MiB")
    if total > limit:
        print(f"the wheels exceed the limit of {limit:.1f} MiB: they would not travel to the device "
              "with the repository (--limit-mib)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
