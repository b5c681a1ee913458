"""What a recipe trains on: its checkpoint, its PickScore model and its prompt files.

Proxy scales: ours, made from a seed (once, then reused) only outside a dry run, which must stay
free of side effects and of torch: the makers (miles.proxy_assets) are imported when they are called.
`--scale full`: the released checkpoint and PickScore (a folder of that name under --model-dir
when there is one, else fetched from the Hub into the shared cache) and flow_grpo's real prompt
sets (released_assets); a dry run prints the fetch commands instead of running them.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional, Protocol

from miles.proxy_assets import checkpoint_name, is_built_pickscore, is_current_checkpoint, tiny_pickscore_name
from miles.launcher import released_assets
from miles.launcher.deferred_fetches import deferring
from miles.launcher.launch_mode import is_dry_run
from miles.launcher.recipe_options import RolloutScale
from miles.diffusion_facts.families import FAMILIES, get_family_facts

RELEASED_PICKSCORE = "PickScore_v1"  # a CLIPModel folder under --model-dir, for --scale full
EVAL_PROMPTS = 64
SEED = 0  # of the checkpoints and the PickScore model we create

PathLike = str | os.PathLike


class AssetDirs(Protocol):
    """A recipe's ScriptArgs with --model-dir and --data-dir."""

    model_dir: str
    data_dir: str


class Assets(NamedTuple):
    checkpoint: str
    prompt_data: str
    eval_prompt_data: str = ""  # "" when the recipe does not evaluate
    pickscore: str = ""  # "" when the reward needs no PickScore model


@contextmanager
def _writable(flag: str, folder: Path):
    """prepare()'s writes under a recipe's folder option: a folder it cannot write is one line
    naming the option (exit 2), not a traceback."""
    try:
        yield
    except OSError as err:
        print(f"error: {flag} {folder}: cannot write there ({err.strerror or err}: {err.filename or folder}); "
              f"fix: give {flag} a folder you can write to", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def ensure_recipe_checkpoint(family: str, size: Optional[str], model_dir: PathLike, released: str = "") -> str:
    """size None: the released checkpoint, `<model-dir>/<released>` when that folder exists, else
    fetched from the Hub (released_assets.RELEASED_CHECKPOINTS); else ours,
    `<model-dir>/miles-<family>-<size>-seed0`, created once outside a dry run."""
    model_dir = Path(model_dir)
    if size is None:
        return _released(model_dir, released, released_assets.RELEASED_CHECKPOINTS.get(released))
    cached = model_dir / checkpoint_name(family, size, SEED)
    if is_dry_run() or is_current_checkpoint(cached, size):
        return str(cached)
    from miles.proxy_assets.checkpoint import ensure_checkpoint

    with _writable("--model-dir", model_dir):
        return str(ensure_checkpoint(family, size, SEED, model_dir))


def refuse_unrunnable_release(family: str, released: str, model_dir: Path) -> None:
    """Refuse, before anything is fetched, a released checkpoint whose transformer class is not the
    one the family runs: the preflight would refuse it too, but only once tens of GB are on disk.
    A folder of that name under --model-dir is the user's own and is left to the preflight."""
    asset = released_assets.RELEASED_CHECKPOINTS.get(released)
    expected = get_family_facts(family).transformer_class
    if asset is None or asset.transformer_class in ("", expected) or (model_dir / released).is_dir():
        return
    runs = [f.name for f in FAMILIES.values() if f.transformer_class == asset.transformer_class]
    who = (f"family `{runs[0]}` runs it (the recipe's FAMILY should be `{runs[0]}`)" if runs
           else f"no family of this project runs {asset.transformer_class} yet")
    raise released_assets.UnrunnableCheckpointError(
        f"--scale full: {released} ({asset.repo_id}) is a {asset.transformer_class} checkpoint and family "
        f"`{family}` runs {expected}; {who}, so nothing "
        f"was fetched; fix: --scale gpu-proxy or --scale cpu-proxy (our {family} checkpoints), or put a "
        f"{family} checkpoint in diffusers layout at {model_dir / released}")


def ensure_pickscore(size: Optional[str], model_dir: PathLike) -> str:
    """The released PickScore beside a released checkpoint (size None); else our tiny CLIP."""
    model_dir = Path(model_dir)
    if size is None:
        return _released(model_dir, RELEASED_PICKSCORE, released_assets.PICKSCORE)
    cached = model_dir / tiny_pickscore_name(SEED)
    if is_dry_run() or is_built_pickscore(cached):
        return str(cached)
    from miles.proxy_assets.pickscore import ensure_tiny_pickscore

    return str(ensure_tiny_pickscore(model_dir, seed=SEED))


def ensure_prompt_files(
    kind: str, data_dir: PathLike, num_prompts: int, eval_prompts: int = EVAL_PROMPTS
) -> tuple[str, str]:
    """`<kind>_prompts_<n>.jsonl` (seed 0) and `<kind>_eval_prompts_<m>.jsonl` (seed 1, "" when
    eval_prompts is 0): the built-in prompt set `kind` of miles.proxy_assets.prompts."""
    data_dir = Path(data_dir)
    prompt_data = data_dir / f"{kind}_prompts_{num_prompts}.jsonl"
    eval_prompt_data = data_dir / f"{kind}_eval_prompts_{eval_prompts}.jsonl" if eval_prompts else None
    if not is_dry_run():
        from miles.proxy_assets.prompts import ensure_prompt_file

        with _writable("--data-dir", data_dir):
            ensure_prompt_file(kind, prompt_data, num_prompts=num_prompts, seed=0)
            if eval_prompt_data is not None:
                ensure_prompt_file(kind, eval_prompt_data, num_prompts=eval_prompts, seed=1)
    return str(prompt_data), str(eval_prompt_data or "")


def _released(model_dir: Path, name: str, asset: Optional[released_assets.HubAsset]) -> str:
    """A released model: the folder under --model-dir if present, else the Hub's: its cached
    snapshot, or (a real launch) its hub id, which the launcher fetches once its checks pass."""
    placed = model_dir / name
    if placed.is_dir() or asset is None:
        return str(placed)
    if deferring() and released_assets.cached_snapshot(asset) is None:
        return asset.hub_id
    return ensure_released_or_exit(released_assets.ensure_hub_asset, asset)


def ensure_released_or_exit(make, *args):
    """Run an asset maker; an asset that cannot be had (offline, not cached) is one line, exit 2,
    before anything of the launch starts."""
    try:
        return make(*args)
    except (released_assets.AssetMissingError, released_assets.UnrunnableCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def ensure_assets(
    family: str, scale: RolloutScale, options: AssetDirs, *, released: str, prompts: str = "general",
    pickscore: bool = False,
) -> Assets:
    """The checkpoint for the scale, its train and eval prompt files and, with pickscore, the
    PickScore model that goes with the checkpoint; a dry run only names them."""
    return ensure_released_or_exit(_ensure_assets, family, scale, options, released, prompts, pickscore)


def _ensure_assets(family: str, scale: RolloutScale, options: AssetDirs, released: str, prompts: str,
                   pickscore: bool) -> Assets:
    if scale.checkpoint_size is None:  # full scale: the real prompt sets, their own train/test halves
        if not is_dry_run():
            refuse_unrunnable_release(family, released, Path(options.model_dir))
        prompt_data, eval_prompt_data = released_assets.ensure_released_prompts(
            released_assets.FULL_SCALE_PROMPTS[prompts], options.data_dir, later=deferring())
    else:
        prompt_data, eval_prompt_data = ensure_prompt_files(prompts, options.data_dir, scale.num_prompts)
    checkpoint = ensure_recipe_checkpoint(family, scale.checkpoint_size, options.model_dir, released)
    reward_model = ensure_pickscore(scale.checkpoint_size, options.model_dir) if pickscore else ""
    return Assets(checkpoint, prompt_data, eval_prompt_data, reward_model)
