"""Preflight: what the launcher checks on this host before it starts anything (dry run or real).

A bad input found here costs one line and exit status 2 in well under 2 s, instead of a Ray
cluster, actors and a traceback half a minute later. No torch, no Ray, no user code executed: a
custom reward or loss is found and its signature read from its source (ast), not imported.

Checked, in order: node and device counts; the output and --save directories are writable; the
--hf-checkpoint directory is complete for its family (miles.records.checkpoint_layout), its
transformers are the class the family runs and the optional libraries their forward needs are
importable here (torchvision for a released Cosmos transformer); height,
width and frames fit the family's VAE and patch sizes; the prompt files read and parse, with
enough distinct prompts for a rollout batch; custom reward / loss functions exist with the right
parameters; --lora-target-modules names modules the transformers have (read from the weights'
headers); --save holds no other run's checkpoints and --load names a checkpoint trained with
this run's flags and data order (miles.records.checkpoint_identity), whose weights files are whole.

train_diffusion.py runs the same checks (check_parsed) before Ray starts, --validate-only included.

A dry run skips the checks of the files a recipe makes on first use (checkpoint, prompt files)
when they do not exist yet, and runs the rest.
"""

from __future__ import annotations

import ast
import json
import os
import time
from argparse import Namespace
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from miles.records import checkpoint_identity as identity
from miles.records import checkpoint_layout as layout
from miles.utils import safetensors_headers as headers
from miles.diffusion_facts.families import get_family_facts


class PreflightError(ValueError):
    """One line: what is wrong, naming the flag, and the fix."""


@dataclass(frozen=True)
class HostFacts:
    """What the preflight needs from the launcher besides the train argv."""

    num_nodes: int
    cuda_visible_devices: str
    dry_run: bool
    import_paths: tuple[str, ...] = ()  # where the job finds user modules (its PYTHONPATH)


def preflight(argv: list[str], host: HostFacts) -> Namespace:
    """Run every check over the assembled train argv; PreflightError on the first failure."""
    from miles.flags.arguments import parse_and_plan

    ns, _ = parse_and_plan(argv)
    check_parsed(ns, host)
    return ns


def check_parsed(ns: Namespace, host: HostFacts) -> None:
    """Every check over flags already parsed (train_diffusion.py run directly has them)."""
    for check in (check_counts, check_writable, check_hf_checkpoint, check_resolution, check_prompt_files,
                  check_custom_functions, check_lora_targets, check_checkpoints):
        check(ns, host)


# ---- nodes and devices ----

def check_counts(ns: Namespace, host: HostFacts) -> None:
    if int(host.num_nodes) < 1:
        raise PreflightError(f"--num-nodes {host.num_nodes}: a run needs at least one node; fix: --num-nodes 1 "
                             f"(or more, with start_ray_worker on each other node)")
    if host.cuda_visible_devices and ns.device == "cpu":
        raise PreflightError(f"--cuda-visible-devices {host.cuda_visible_devices} with --device cpu: a CPU run uses "
                             f"no GPU; fix: drop --cuda-visible-devices, or run with --device cuda")


# ---- directories ----

def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(path: Path) -> bool:
    found = _nearest_existing(path)
    return found.is_dir() and os.access(found, os.W_OK | os.X_OK)


def check_writable(ns: Namespace, host: HostFacts) -> None:
    for flag, value in (("--output-dir", ns.run_dir), ("--save", ns.save)):
        if value and not _writable(Path(value)):
            where = _nearest_existing(Path(value))
            raise PreflightError(f"{flag}: cannot write {value} ({where} is not a writable directory); fix: pick a "
                                 f"directory you can write to")


# ---- the checkpoint trained from ----

def check_hf_checkpoint(ns: Namespace, host: HostFacts) -> None:
    path = Path(ns.hf_checkpoint)
    if host.dry_run and not path.exists():
        return  # a recipe makes it on first use
    family = get_family_facts(ns.diffusion_model_family)
    problems = layout.missing_parts(path, ("vae", *family.transformer_components, *family.extra_components))
    if problems:
        raise PreflightError(f"--hf-checkpoint {path} is not a complete {family.name} checkpoint: "
                             f"{'; '.join(problems[:3])}; fix: point --hf-checkpoint at a complete diffusers "
                             f"checkpoint (components, {layout.INDEX}, weights), or delete it so the recipe rebuilds it")
    _check_transformer_classes(path, family)
    _check_libraries(path)


def _check_transformer_classes(path: Path, family) -> None:
    named = layout.components(path)
    for name in family.transformer_components:
        found = named.get(name)
        if family.transformer_class and found != family.transformer_class:
            raise PreflightError(f"--hf-checkpoint {path}: its {name}/ is a {found}, but the {family.name} family "
                                 f"runs a {family.transformer_class} (another architecture needs its own family code); "
                                 f"fix: point --hf-checkpoint at a {family.name} checkpoint whose {name} is a "
                                 f"{family.transformer_class}, or pick the --diffusion-model-family of this one")


def _check_libraries(path: Path) -> None:
    for library, why in layout.libraries_needed(path).items():
        if PathFinder.find_spec(library) is None:
            raise PreflightError(f"--hf-checkpoint {path}: {why} needs {library} in its forward, and {library} is "
                                 f"not installed here; fix: pip install {library} (the build that matches your "
                                 f"torch), or pip install 'miles-diffusion[{library}]'")


def check_resolution(ns: Namespace, host: HostFacts) -> None:
    grid = layout.pixel_grid(ns.hf_checkpoint)
    if grid is None:
        return
    for flag, value in (("--diffusion-height", ns.diffusion_height), ("--diffusion-width", ns.diffusion_width)):
        if value % grid.spatial:
            below, above = grid.nearest(value)
            raise PreflightError(f"{flag} {value} is not a multiple of {grid.spatial} (the VAE's downsampling x the "
                                 f"transformer's patch size of {ns.hf_checkpoint}); fix: {flag} {below} or {above}")
    frames = ns.diffusion_output_num_frames
    if get_family_facts(ns.diffusion_model_family).is_video and not grid.frames_ok(frames):
        below, above = grid.nearest_frames(frames)
        raise PreflightError(f"--diffusion-output-num-frames {frames} does not fit the VAE's temporal compression "
                             f"{grid.temporal} (frames = 1 + a multiple of it, latent frames a multiple of the patch "
                             f"{grid.patch_t}); fix: --diffusion-output-num-frames {below} or {above}")


# ---- prompt files ----

def check_prompt_files(ns: Namespace, host: HostFacts) -> None:
    from miles.rollout.data import PromptDataError, read_prompt_file

    sft = ns.loss_type == "sft_loss"
    for flag, path in (("--prompt-data", ns.prompt_data), ("--eval-prompt-data", ns.eval_prompt_data)):
        if not path or (host.dry_run and not Path(path).exists()):
            continue
        if not Path(path).is_file() or not os.access(path, os.R_OK):
            raise PreflightError(f"{flag} {path}: no readable file there; fix: give the path of a JSONL file")
        if sft:
            continue  # SFT items are read by their own dataset (images, sizes) when the run starts
        try:
            items = read_prompt_file(path, ns.input_key, ns.metadata_key)
        except PromptDataError as err:  # a message with its own fix (not UTF-8) keeps it
            fix = "" if "fix:" in str(err) else (f"; fix: make each line a JSON object with the prompt under "
                                                 f"--input-key {ns.input_key!r}")
            raise PreflightError(f"{flag}: {err}{fix}") from None
        distinct = len({item.prompt for item in items})
        if flag == "--prompt-data" and distinct < ns.rollout_batch_size:
            raise PreflightError(f"--prompt-data {path} holds {distinct} distinct prompt(s) but --rollout-batch-size "
                                 f"asks for {ns.rollout_batch_size} per rollout; fix: give a file with at least "
                                 f"{ns.rollout_batch_size} distinct prompts, or --rollout-batch-size {distinct}")


# ---- custom functions, found and read without running them ----

# flag -> (positional parameters the trainer passes, the contract shown in the fix)
CUSTOM_FUNCTIONS = {
    "--custom-rm-path": (2, "async def rm(args, samples) -> list[float]"),
    "--rm-type": (2, "async def rm(args, samples) -> list[float]"),
    "--custom-loss-function-path": (2, "def loss(args, inputs) -> (loss, metrics)"),
}


def check_custom_functions(ns: Namespace, host: HostFacts) -> None:
    paths = (("--custom-rm-path", ns.custom_rm_path),
             ("--rm-type", ns.rm_type if ns.rm_type and ":" in ns.rm_type else None),
             ("--custom-loss-function-path", ns.custom_loss_function_path))
    search = [*host.import_paths, os.getcwd()]
    for flag, dotted in paths:
        if dotted:
            nargs, contract = CUSTOM_FUNCTIONS[flag]
            problem = function_problem(dotted, nargs, search)
            if problem:
                raise PreflightError(f"{flag} {dotted}: {problem}; fix: name a function {contract} in a module "
                                     f"on the job's PYTHONPATH")


def function_problem(dotted: str, nargs: int, search: list[str]) -> str | None:
    from miles.utils.dotted_path import DottedPathError, split_dotted_path

    try:
        module, name = split_dotted_path(dotted)
    except DottedPathError as err:
        return str(err)
    origin = module_source(module, search)
    if origin is None:
        return f"module {module!r} not found"
    if not origin.endswith(".py"):
        return None  # compiled or namespace: cannot read it without importing it
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
    except (OSError, SyntaxError, UnicodeDecodeError) as err:
        return f"module {module!r} ({origin}) does not parse: {err}"
    return _signature_problem(tree, module, name, nargs)


def module_source(module: str, search: list[str]) -> str | None:
    """The file `module` would import from, found without importing it or its packages."""
    parts = module.split(".")
    paths = list(dict.fromkeys([*search, *__import__("sys").path]))
    spec = None
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), paths)
        if spec is None:
            return None
        paths = list(spec.submodule_search_locations or [])
    return spec.origin if spec is not None else None


def _signature_problem(tree: ast.Module, module: str, name: str, nargs: int) -> str | None:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            a = node.args
            positional = len(a.posonlyargs) + len(a.args)
            required = positional - len(a.defaults)
            if a.vararg is None and positional < nargs:
                params = ", ".join(p.arg for p in (*a.posonlyargs, *a.args)) or "none"
                return f"{name}() takes {positional} positional parameter(s) ({params}), the trainer passes {nargs}"
            if required > nargs:
                return f"{name}() requires {required} positional parameters, the trainer passes {nargs}"
            return None
        if _binds(node, name):
            return None  # assigned or imported: a callable we cannot inspect without running the module
    return f"module {module!r} defines no function {name!r}"


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    if isinstance(node, ast.ClassDef):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


# ---- checkpoints of runs ----

def check_checkpoints(ns: Namespace, host: HostFacts) -> None:
    try:
        identity.check_save_dir(ns.save, identity.run_id_of(ns), ns.load)
        if ns.load:  # whole files first: no flag (--load-anyway included) makes a cut-short file load
            _check_checkpoint_weights(ns, identity.find_load(ns.load).path)
        identity.check_load(ns)
    except identity.CheckpointRefused as err:
        raise PreflightError(str(err)) from None


def _check_checkpoint_weights(ns: Namespace, path: Path) -> None:
    """The weights files of the checkpoint --load resumes are there and whole (headers read, no
    tensor loaded): a deleted or truncated one is named now, not by a rank's traceback after Ray starts."""
    fix = "fix: restore that file, or give --load a copy of the run's checkpoints whose latest is whole"
    written_by = _read_json_file(path / "rank0.json") or {}
    if written_by.get("backend") == "dp" and not list(path.glob("model_*.safetensors")):
        expected = " or ".join(f"model_{c}.safetensors" for c in
                               get_family_facts(ns.diffusion_model_family).transformer_components)
        raise PreflightError(f"--load {ns.load}: {path} has no {expected} (the trained weights were deleted?); "
                             f"{fix}")
    for weights in sorted(path.glob("*.safetensors")):
        try:
            headers.read_header(weights)
        except (OSError, headers.HeaderError) as err:
            raise PreflightError(f"--load {ns.load}: {weights} is not whole: {err}; {fix}") from None


def _read_json_file(path: Path) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


# ---- LoRA targets, matched against the checkpoint's weight names ----

def _leaf(module: str) -> str:
    """The name a target gives for `module`: its last part, with its parent when that part is an
    index (`to_out.0`)."""
    parts = module.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def check_lora_targets(ns: Namespace, host: HostFacts) -> None:
    """Each transformer has a module that --lora-target-modules names, matched as PEFT matches a list
    (the module's name, or its dotted suffix); the weight names come from the safetensors headers."""
    if not ns.use_lora or not ns.lora_target_modules:
        return
    targets = list(ns.lora_target_modules)
    for component in get_family_facts(ns.diffusion_model_family).transformer_components:
        folder = Path(ns.hf_checkpoint) / component
        try:
            names = headers.tensor_names(folder) if folder.is_dir() else None
        except (OSError, headers.HeaderError):
            names = None  # an unreadable weights file is check_hf_checkpoint's to report
        if not names:
            continue
        modules = {name.rsplit(".", 1)[0] for name in names if "." in name}
        if not any(m == t or m.endswith("." + t) for m in modules for t in targets):
            leaves = sorted({_leaf(m) for m in modules})
            shown = ", ".join(leaves[:16]) + (f", ... ({len(leaves)} in all)" if len(leaves) > 16 else "")
            raise PreflightError(f"--lora-target-modules {' '.join(targets)} matches no module of the "
                                 f"{ns.diffusion_model_family} {component} in {ns.hf_checkpoint}; its module names "
                                 f"end in: {shown}; fix: name some of them (or drop the flag for the family's "
                                 f"default)")


# ---- the record a refused launch leaves ----

def write_refusal(run_dir: str, reason: str, argv: str, plan: dict | None = None) -> Path | None:
    """`<run_dir>/refused-<UTC time>-<pid>.json`: a refused launch's own record, written beside an
    earlier run's plan.json, run.json and checkpoints without touching them. None if unwritable."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(run_dir) / f"refused-{stamp}-{os.getpid()}.json"
    record = {"refused_at": stamp, "reason": reason, "argv": argv, **({"plan": plan} if plan else {})}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError:
        return None
    return path
