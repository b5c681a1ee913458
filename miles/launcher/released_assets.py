"""The released assets a `--scale full` recipe trains on, fetched from their public sources into
a cache every run shares: checkpoints and PickScore from the Hugging Face Hub (`hf download`,
which resumes a partial download), the prompt sets flow_grpo trains and evaluates on from its
repository at a pinned commit (`curl -C -`, resumable).

Where things go: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` (the
Hub's own layout, so a checkpoint fetched by any Hugging Face tool is found and reused); prompt
files under `<HF_HOME>/miles-prompts/`. `HF_HUB_OFFLINE=1` means no network: an asset missing
from the cache stops the launch with one line naming it, its cache path and the command that
fetches it. A dry run only names the paths and prints the commands (it fetches nothing).

Every fetch goes through `exec_command`, so it is printed as `EXEC: ...` and recorded in the
launch plan (and the dry-run snapshot) as a command prepare() ran.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from miles.launcher.asset_errors import AssetMissingError  # noqa: F401 (raised here, caught by callers)
from miles.launcher.launch_mode import is_dry_run
from miles.launcher.processes import exec_command, write_text_atomically

_SHA = re.compile(r"[0-9a-f]{40}")


class UnrunnableCheckpointError(RuntimeError):
    """A released checkpoint whose architecture the recipe's family does not run; one line."""


@dataclass(frozen=True)
class HubAsset:
    """A repository on the Hugging Face Hub, at a revision."""

    name: str  # what a recipe calls it (its folder name under --model-dir before)
    repo_id: str
    revision: str = "main"  # a commit sha pins it; a branch name resolves once and is then read from the cache
    repo_type: str = "model"
    marker: str = ""  # a file a complete snapshot holds (model_index.json for a diffusers checkpoint)
    transformer_class: str = ""  # a checkpoint's: the `_class_name` of its transformer/config.json

    @property
    def cache_folder(self) -> str:
        return f"{self.repo_type}s--{self.repo_id.replace('/', '--')}"

    @property
    def hub_id(self) -> str:
        """`org/name[@revision]`, as --hf-checkpoint takes it (the launcher fetches it)."""
        return self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class PromptFile:
    """One prompt file of a public repository at a pinned commit (one prompt per line)."""

    name: str
    repo: str  # GitHub owner/name
    commit: str
    path: str

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"


def _diffusers(name: str, repo_id: str, transformer_class: str) -> HubAsset:
    return HubAsset(name, repo_id, marker="model_index.json", transformer_class=transformer_class)


# The released checkpoints, by the folder name recipes give (`released=`). A branch revision is
# resolved by the first fetch and read from the cache's refs afterwards (the Hub's own rule).
RELEASED_CHECKPOINTS: dict[str, HubAsset] = {
    a.name: a for a in (
        _diffusers("stable-diffusion-3.5-medium", "stabilityai/stable-diffusion-3.5-medium", "SD3Transformer2DModel"),
        _diffusers("stable-diffusion-3.5-large", "stabilityai/stable-diffusion-3.5-large", "SD3Transformer2DModel"),
        _diffusers("Qwen-Image", "Qwen/Qwen-Image", "QwenImageTransformer2DModel"),
        _diffusers("Wan2.2-T2V-A14B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "WanTransformer3DModel"),
        _diffusers("Cosmos-Predict2-2B-Text2Image", "nvidia/Cosmos-Predict2-2B-Text2Image", "CosmosTransformer3DModel"),
        # Lightricks/LTX-2.3 itself is one single-file checkpoint (DiT, VAEs, vocoder, connectors by
        # key prefix), not a diffusers layout; this is its diffusers conversion (LTX2Pipeline), which
        # the ltx2 family runs
        _diffusers("LTX-2.3", "diffusers/LTX-2.3-Diffusers", "LTX2VideoTransformer3DModel"),
    )
}
PICKSCORE = HubAsset("PickScore_v1", "yuvalkirstain/PickScore_v1", marker="config.json")
# Hub checkpoints miles-diffusion's recipes train that no family here runs, and why: refused from
# the hub id alone, before anything is fetched (the preflight would refuse them only once on disk)
FOREIGN_CHECKPOINTS = {
    "nvidia/Cosmos3-Nano": "a mixture-of-transformers (understanding and generation towers), not the "
                           "CosmosTransformer3DModel the cosmos3 family runs (Cosmos-Predict2)",
    "Lightricks/LTX-2.3": "one single-file checkpoint, not a diffusers layout; its diffusers conversion "
                          "diffusers/LTX-2.3-Diffusers is what the ltx2 family runs",
    "MiniMaxAI/MiniMax-H3": "MiniMax-H3, which no family of this project runs",
    "krea/Krea-2-Raw": "Krea 2, which no family of this project runs",
    "Qwen/Qwen-Image-2.1": "Qwen-Image 2.1, which no family of this project runs (qwen_image runs Qwen/Qwen-Image)",
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": "Wan2.2's TI2V-5B (one expert, image conditioning), which no family of this "
                                       "project runs (wan2_2 runs the two-expert T2V-A14B)",
}


def foreign_checkpoint(value: str) -> str | None:
    """Why a hub id given to --hf-checkpoint cannot run here, or None."""
    return FOREIGN_CHECKPOINTS.get(value.partition("@")[0])


# Repositories whose files the Hub serves only to an account that accepted their licence, with its token
GATED_REPOS = ("stabilityai/stable-diffusion-3.5-medium", "stabilityai/stable-diffusion-3.5-large")
TOKEN_ENV = "HF_TOKEN"


def gated_note(repo_id: str) -> str | None:
    """What a gated repository needs before `hf download` can fetch it, or None."""
    if repo_id not in GATED_REPOS:
        return None
    return (f"{repo_id} is gated: accept its licence at https://huggingface.co/{repo_id} with your Hugging Face "
            f"account, then export {TOKEN_ENV} (a token of that account; or run `hf auth login` once)")


def gated_assets_in(texts: list[str]) -> list[dict[str, str]]:
    """The gated repositories a launch names (a hub id, a fetch command or a cache path among `texts`)."""
    found = [r for r in GATED_REPOS if any(r in t or r.replace("/", "--") in t for t in texts)]
    return [{"repo": r, "licence": f"https://huggingface.co/{r}", "token": TOKEN_ENV} for r in found]

# flow_grpo's prompt sets (yifan123/flow_grpo, dataset/<set>/{train,test}.txt): the train and
# test halves are disjoint, which the prompt loader checks again on every run.
FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")
PROMPT_SETS: dict[str, tuple[PromptFile, PromptFile]] = {
    kind: (PromptFile(f"{kind}-train", *FLOW_GRPO, f"dataset/{kind}/train.txt"),
           PromptFile(f"{kind}-test", *FLOW_GRPO, f"dataset/{kind}/test.txt"))
    for kind in ("pickscore", "ocr")
}
# what a recipe's built-in prompt kind becomes at full scale: scene prompts are PickScore's set
FULL_SCALE_PROMPTS = {"general": "pickscore", "pickscore": "pickscore", "ocr": "ocr"}


# ---- the cache ----

def hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "huggingface"


def hub_cache() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(explicit).expanduser() if explicit else hf_home() / "hub"


def prompts_cache() -> Path:
    return hf_home() / "miles-prompts"


def is_offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def cached_snapshot(asset: HubAsset, cache: Path | None = None) -> Path | None:
    """The complete snapshot of `asset` at its revision in the cache, or None."""
    repo_dir = (cache or hub_cache()) / asset.cache_folder
    sha = asset.revision if _SHA.fullmatch(asset.revision) else _read_ref(repo_dir, asset.revision)
    if sha is None:
        return None
    snapshot = repo_dir / "snapshots" / sha
    if not snapshot.is_dir() or (asset.marker and not (snapshot / asset.marker).is_file()):
        return None
    return snapshot


def _read_ref(repo_dir: Path, revision: str) -> str | None:
    try:
        return (repo_dir / "refs" / revision).read_text().strip() or None
    except OSError:
        return None


def hub_fetch_command(asset: HubAsset, cache: Path | None = None, include: str | None = None) -> str:
    words = ["hf", "download", asset.repo_id, "--revision", asset.revision]
    if asset.repo_type != "model":
        words += ["--repo-type", asset.repo_type]
    if include:
        words += ["--include", include]
    return shlex.join(words + ["--cache-dir", str(cache or hub_cache())])


def prompt_fetch_command(item: PromptFile, dest: Path) -> str:
    part = f"{dest}.part"
    return (f"mkdir -p {shlex.quote(str(dest.parent))} && curl -fL --retry 3 -C - -o {shlex.quote(part)} "
            f"{shlex.quote(item.url)} && mv {shlex.quote(part)} {shlex.quote(str(dest))}")


def _missing(what: str, where: Path, command: str, gated: str | None = None) -> AssetMissingError:
    return AssetMissingError(
        f"{what} is not in the cache ({where}) and HF_HUB_OFFLINE=1 forbids fetching it; "
        f"fetch it once online with: {command}" + (f" ({gated})" if gated else "")
    )


# curl's exit statuses a failed prompt download most often ends with (curl(1), EXIT CODES)
_CURL_EXITS = {6: "could not resolve the host", 7: "could not connect", 22: "the server answered with an HTTP error",
               28: "timed out", 35: "TLS handshake failed", 56: "the connection broke off"}


def download_failed(what: str, failed: str, check: str, seed: str) -> AssetMissingError:
    """One line for a fetch that exited non-zero: what, how it failed, and the two fixes (the network
    or account, or the file put in place by hand, where the next launch looks before it fetches)."""
    return AssetMissingError(f"could not download {what}: {failed}; fix: {check}, or pre-seed it: {seed} (the launch "
                             f"then uses it from there and fetches nothing)")


# ---- fetching ----

def ensure_hub_asset(asset: HubAsset, include: str | None = None) -> str:
    """The local snapshot directory of `asset`: from the cache, else fetched (resumable) into it;
    `include` fetches only the files matching it. A dry run prints the fetch command and names the
    path the snapshot will have."""
    cache = hub_cache()
    found = cached_snapshot(asset, cache)
    if found is not None and (not include or any(found.glob(include))):  # another subset may be all it holds
        return str(found)
    command = hub_fetch_command(asset, cache, include)
    gated = gated_note(asset.repo_id)
    if gated and not is_dry_run() and not os.environ.get(TOKEN_ENV):
        print(f"note: {gated}", flush=True)
    if is_offline():
        raise _missing(f"{asset.name} ({asset.repo_id}@{asset.revision})", cache / asset.cache_folder, command,
                       gated)
    try:
        exec_command(command)
    except subprocess.CalledProcessError as err:
        why = "check this host's network and the repository id; " + (gated or f"a private repository needs {TOKEN_ENV}")
        raise download_failed(f"{asset.repo_id}@{asset.revision}", f"`{command}` exited {err.returncode}", why,
                              f"run that command on a machine that is online and copy {cache / asset.cache_folder} "
                              f"to the same path here") from None
    if is_dry_run():
        return str(cache / asset.cache_folder / "snapshots" / asset.revision)
    found = cached_snapshot(asset, cache)
    if found is None:
        raise AssetMissingError(f"`{command}` finished but {cache / asset.cache_folder} holds no complete "
                                f"snapshot of {asset.repo_id}@{asset.revision} (no {asset.marker or 'snapshot'})")
    return str(found)


def resolve_hf_checkpoint(value: str, marker: str = "model_index.json") -> str:
    """`--hf-checkpoint` as a directory (kept) or a hub id `org/name[@revision]` (its cached snapshot,
    fetched when online)."""
    if not value or Path(value).exists() or value.startswith(("/", ".", "~")) or value.count("/") != 1:
        return value
    repo_id, _, revision = value.partition("@")
    return ensure_hub_asset(HubAsset(repo_id.split("/")[1], repo_id, revision or "main", marker=marker))


def prompt_cache_path(item: PromptFile) -> Path:
    return prompts_cache() / item.repo.replace("/", "--") / item.commit / item.path


def ensure_prompt_file(item: PromptFile) -> Path:
    """The cached copy of a pinned prompt file (fetched, resumably, when missing)."""
    dest = prompt_cache_path(item)
    if dest.is_file():
        return dest
    command = prompt_fetch_command(item, dest)
    if is_offline():
        raise _missing(f"prompt set {item.name} ({item.repo}@{item.commit[:12]}:{item.path})", dest, command)
    try:
        exec_command(command)
    except subprocess.CalledProcessError as err:
        meaning = f" ({_CURL_EXITS[err.returncode]})" if err.returncode in _CURL_EXITS else ""
        raise download_failed(f"prompt set {item.name} ({item.url})", f"curl exited {err.returncode}{meaning}",
                              "check this host's network (DNS; a proxy through https_proxy)",
                              f"download that URL on a machine that is online and put the file at {dest}") from None
    return dest


def ensure_released_prompts(kind: str, data_dir: str | os.PathLike, later: bool = False) -> tuple[str, str]:
    """flow_grpo's train and test prompts of `kind` as JSONL files under data_dir (train, eval);
    `later`: a prompt file not cached yet is fetched once the launch's checks pass (deferred_fetches)."""
    from miles.launcher.deferred_fetches import defer

    outputs = []
    for item in PROMPT_SETS[kind]:
        out = Path(data_dir) / f"{kind}_{item.name.rsplit('-', 1)[1]}_{item.commit[:12]}.jsonl"
        if later and not out.is_file() and not prompt_cache_path(item).is_file():
            defer(f"prompt set {item.name}", lambda item=item, out=out: _prompts_as_jsonl(item, out))
        else:
            _prompts_as_jsonl(item, out)
        outputs.append(str(out))
    return outputs[0], outputs[1]


def _prompts_as_jsonl(item: PromptFile, out: Path) -> None:
    source = ensure_prompt_file(item)
    if not is_dry_run() and not out.is_file():
        write_text_atomically(out, prompt_lines_as_jsonl(source.read_text(encoding="utf-8")))


def prompt_lines_as_jsonl(text: str) -> str:
    """One `{"prompt": line}` record per non-blank line, in file order."""
    return "".join(json.dumps({"prompt": line.strip()}) + "\n" for line in text.splitlines() if line.strip())


# flags of a train argv that take a model directory, and the file a complete snapshot of it holds
MODEL_PATH_FLAGS = {"--hf-checkpoint": "model_index.json", "--sft-encoder-checkpoint": "model_index.json",
                    "--pickscore-model-path": "config.json",
                    "--pickscore-processor-path": "preprocessor_config.json"}


def resolve_checkpoints_in_argv(argv: list[str]) -> list[str]:
    """Each hub id given to a model flag (MODEL_PATH_FLAGS) replaced by its cached (or fetched) snapshot."""
    out = list(argv)
    for i, word in enumerate(out):
        flag, eq, inline = word.partition("=")
        if flag not in MODEL_PATH_FLAGS:
            continue
        if eq:
            out[i] = f"{flag}={resolve_hf_checkpoint(inline, MODEL_PATH_FLAGS[flag])}"
        elif i + 1 < len(out):
            out[i + 1] = resolve_hf_checkpoint(out[i + 1], MODEL_PATH_FLAGS[flag])
    return out
