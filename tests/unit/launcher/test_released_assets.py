"""Full-scale assets without a network: a stand-in `hf` (and `curl`) on PATH writes what the real
tools write (the Hugging Face cache layout; the requested file) and records how it was called, so
fetch, reuse, revision pins and the offline error are checked as a user meets them."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from miles.launcher import released_assets as R

REPO = Path(__file__).resolve().parents[3]
SHA = "0123456789abcdef0123456789abcdef01234567"

# `hf download REPO --revision REV [--repo-type T] --cache-dir C`: the snapshot, a ref for a branch
STAND_IN_HF = f'''#!{sys.executable}
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write(json.dumps(["hf", *argv]) + "\\n")
opt = lambda name, default=None: argv[argv.index(name) + 1] if name in argv else default
repo, rev, kind = argv[1], opt("--revision", "main"), opt("--repo-type", "model")
repo_dir = Path(opt("--cache-dir")) / (kind + "s--" + repo.replace("/", "--"))
sha = rev if len(rev) == 40 else "{SHA}"
snap = repo_dir / "snapshots" / sha
snap.mkdir(parents=True, exist_ok=True)
for name in ("model_index.json", "config.json"):
    (snap / name).write_text("{{}}")
if sha != rev:
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / rev).write_text(sha)
print(snap)
'''

# `curl ... -o OUT URL`: one prompt per line, a train and a test half that share nothing
STAND_IN_CURL = f'''#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write(json.dumps(["curl", *argv]) + "\\n")
out, url = argv[argv.index("-o") + 1], argv[-1]
half = "test" if url.endswith("test.txt") else "train"
open(out, "w").write("".join(f"a {{half}} prompt number {{i}}\\n" for i in range(3)))
'''


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """PATH with the stand-ins first, an empty HF_HOME, online, not a dry run; returns the call log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("hf", STAND_IN_HF), ("curl", STAND_IN_CURL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.jsonl"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "1")
    return lambda: [json.loads(line) for line in log.read_text().splitlines()]


ASSET = R.HubAsset("stable-diffusion-3.5-medium", "stabilityai/stable-diffusion-3.5-medium", marker="model_index.json")


def test_fetch_runs_hf_download_into_the_shared_cache_and_returns_the_snapshot(stand_ins, tmp_path):
    path = R.ensure_hub_asset(ASSET)
    cache = tmp_path / "hf-home" / "hub"
    assert path == str(cache / "models--stabilityai--stable-diffusion-3.5-medium" / "snapshots" / SHA)
    assert stand_ins() == [["hf", "download", ASSET.repo_id, "--revision", "main", "--cache-dir", str(cache)]]


def test_a_cached_snapshot_is_reused_without_running_hf(stand_ins):
    first = R.ensure_hub_asset(ASSET)
    assert R.ensure_hub_asset(ASSET) == first
    assert len(stand_ins()) == 1


def test_a_pinned_revision_is_fetched_as_pinned_and_another_revision_in_the_cache_does_not_count(stand_ins):
    R.ensure_hub_asset(ASSET)  # main, resolved to SHA
    pinned = R.HubAsset(ASSET.name, ASSET.repo_id, revision="f" * 40, marker="model_index.json")
    assert R.cached_snapshot(pinned) is None
    assert R.ensure_hub_asset(pinned).endswith("/snapshots/" + "f" * 40)
    assert stand_ins()[-1][3:5] == ["--revision", "f" * 40]


def test_a_partial_snapshot_is_fetched_again(stand_ins, tmp_path):
    snapshot = Path(R.ensure_hub_asset(ASSET))
    (snapshot / "model_index.json").unlink()  # an interrupted download: hf resumes it
    assert R.ensure_hub_asset(ASSET) == str(snapshot)
    assert len(stand_ins()) == 2


def test_offline_with_the_asset_missing_is_one_line_naming_asset_cache_and_command(stand_ins, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(R.AssetMissingError) as missing:
        R.ensure_hub_asset(ASSET)
    message = str(missing.value)
    assert "\n" not in message and stand_ins() == []
    cache = tmp_path / "hf-home" / "hub"
    for part in (ASSET.name, str(cache / ASSET.cache_folder), R.hub_fetch_command(ASSET, cache), "HF_HUB_OFFLINE"):
        assert part in message


def test_offline_with_the_asset_cached_uses_the_cache(stand_ins, monkeypatch):
    fetched = R.ensure_hub_asset(ASSET)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert R.ensure_hub_asset(ASSET) == fetched and len(stand_ins()) == 1


def test_a_dry_run_prints_the_fetch_command_and_runs_nothing(stand_ins, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    path = R.ensure_hub_asset(ASSET)
    assert stand_ins() == [] and not Path(path).exists()
    assert f"EXEC: {R.hub_fetch_command(ASSET, tmp_path / 'hf-home' / 'hub')}" in capsys.readouterr().out


def test_prompt_sets_are_fetched_once_at_their_pinned_commit_and_written_as_jsonl(stand_ins, tmp_path):
    train, held_out = R.ensure_released_prompts("pickscore", tmp_path / "data")
    again = R.ensure_released_prompts("pickscore", tmp_path / "data")
    urls = [call[-1] for call in stand_ins()]
    assert (train, held_out) == again and len(urls) == 2  # the second call reused the cache
    assert all(f"/yifan123/flow_grpo/{R.FLOW_GRPO[1]}/dataset/pickscore/" in url for url in urls)
    rows = [json.loads(line) for line in Path(train).read_text().splitlines()]
    assert rows == [{"prompt": f"a train prompt number {i}"} for i in range(3)]


def test_a_hub_id_given_to_hf_checkpoint_becomes_its_snapshot_and_a_directory_is_kept(stand_ins, tmp_path):
    argv = ["--hf-checkpoint", "org/model@" + "e" * 40, "--pickscore-model-path", str(tmp_path),
            "--hf-checkpoint=org/other"]
    out = R.resolve_checkpoints_in_argv(argv)
    assert out[1].endswith("models--org--model/snapshots/" + "e" * 40)
    assert out[3] == str(tmp_path)
    assert out[4].startswith("--hf-checkpoint=") and out[4].endswith(f"models--org--other/snapshots/{SHA}")


def launch_full_scale(recipe: str, tmp_path: Path, env: dict[str, str], *options: str) -> list[str]:
    """A real (not dry) launch of `recipe` at its default scale, full, expected to stop before it is
    planned: its stderr lines, after checking it exited 2 with one line and planned nothing."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / recipe), "--output-dir", str(out),
                             "--model-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data"), *options],
                            env={**env, "MILES_SCRIPT_ENABLE_RAY_SUBMIT": "1"}, capture_output=True, text=True,
                            timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert not list(out.glob("*/plan.json"))  # stopped in prepare(), before the launch was planned
    return lines


def test_a_real_full_scale_launch_offline_with_an_empty_cache_stops_with_one_line_before_anything_starts(tmp_path):
    """Into an existing cluster (whose GPUs the launcher does not check on this host) every check
    that needs no asset passes, and the first missing asset is the one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "HF_", "WANDB_", "RAY_"))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache"), "MILES_SCRIPT_EXTERNAL_RAY": "1",
                "MILES_SCRIPT_RAY_ADDRESS": "http://127.0.0.1:1"})
    [line] = launch_full_scale("run_diffusion_nft_sd3_pickscore.py", tmp_path, env)
    assert str(tmp_path / "empty-cache") in line and "fetch it" in line
    assert not (tmp_path / "empty-cache").exists()  # nothing was fetched


def test_a_gated_checkpoint_offline_names_its_licence_page_and_hf_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(R.AssetMissingError) as refused:
        R.ensure_hub_asset(R.RELEASED_CHECKPOINTS["stable-diffusion-3.5-medium"])
    assert "accept its licence at https://huggingface.co/stabilityai/stable-diffusion-3.5-medium" in str(refused.value)
    assert "HF_TOKEN" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(R.AssetMissingError) as ungated:
        R.ensure_hub_asset(R.RELEASED_CHECKPOINTS["Qwen-Image"])
    assert "licence" not in str(ungated.value)
    assert R.gated_assets_in(["hf download stabilityai/stable-diffusion-3.5-medium --revision main", "Qwen/Qwen-Image"]) == [
        {"repo": "stabilityai/stable-diffusion-3.5-medium",
         "licence": "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium", "token": "HF_TOKEN"}]


@pytest.mark.parametrize("recipe", ["run_diffusion_nft_sd3_pickscore.py", "run_diffusion_grpo_wan22_pickscore_5gpu.py"])
def test_a_full_scale_launch_offline_with_an_empty_cache_names_a_bad_load_first(tmp_path, recipe):
    """Every check that needs no asset (here --load) runs before prepare()'s downloads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "HF_", "WANDB_"))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")})
    [line] = launch_full_scale(recipe, tmp_path, env, "--extra-args", f"--load {tmp_path / 'no-such-run'}")
    assert line.startswith(f"error: --load {tmp_path / 'no-such-run'}"), line
    assert not (tmp_path / "empty-cache").exists()


def test_the_plan_records_the_commit_a_hub_id_at_main_resolved_to(stand_ins, tmp_path):
    R.ensure_hub_asset(R.HubAsset("model", "org/model", marker="model_index.json"))  # online: main -> SHA
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "WANDB_"))}
    env.update({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0", "HF_HUB_OFFLINE": "1"})  # from the cache alone
    out = tmp_path / "out"
    (tmp_path / "tiny_train.py").write_text("raise SystemExit('a dry run runs no train script')\n")
    result = subprocess.run([sys.executable, str(REPO / "tests/unit/launcher/example_recipe.py"), "train",
                             "--output-dir", str(out), "--run-id", "r1", "--train-script", str(tmp_path / "tiny_train.py"),
                             "--extra-args", "--hf-checkpoint org/model"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plan = json.loads((out / "r1" / "plan.json").read_text())
    assert plan["hub_revisions"] == {"--hf-checkpoint": {"repo_id": "org/model", "repo_type": "model",
                                                         "commit": SHA, "refs": ["main"]}}


def test_a_snapshot_path_names_its_repository_commit_and_branch_and_other_paths_name_none(stand_ins, tmp_path):
    from miles.records.hub_snapshots import hub_revisions_in_argv, snapshot_revision

    dataset = R.ensure_hub_asset(R.HubAsset("sets", "org/sets", repo_type="dataset"))
    pinned = R.ensure_hub_asset(R.HubAsset("model", "org/model", revision="f" * 40, marker="model_index.json"))
    assert snapshot_revision(Path(dataset) / "train.jsonl") == {"repo_id": "org/sets", "repo_type": "dataset",
                                                                 "commit": SHA, "refs": ["main"]}
    assert snapshot_revision(pinned) == {"repo_id": "org/model", "repo_type": "model", "commit": "f" * 40, "refs": []}
    # a dry run names the snapshot folder before any fetch: the branch, no commit yet
    dry = tmp_path / "c" / "models--org--new" / "snapshots" / "main"
    assert snapshot_revision(dry)["commit"] is None and snapshot_revision(dry)["refs"] == ["main"]
    assert snapshot_revision(tmp_path / "my-model") is None
    argv = ["--prompt-data", str(Path(dataset) / "train.jsonl"), f"--hf-checkpoint={pinned}", "--lr", "1e-4",
            "--pickscore-model-path", str(tmp_path), "--eval-prompt-data", "test", str(Path(dataset) / "test.jsonl")]
    assert {flag: rev["commit"] for flag, rev in hub_revisions_in_argv(argv).items()} == {
        "--prompt-data": SHA, "--hf-checkpoint": "f" * 40, "--eval-prompt-data": SHA}


def test_every_released_checkpoint_declares_a_transformer_a_family_runs():
    from miles.diffusion_facts.families import FAMILIES

    runnable = {f.transformer_class for f in FAMILIES.values()}
    declared = {a.name: a.transformer_class for a in R.RELEASED_CHECKPOINTS.values()}
    assert all(declared.values()), declared  # every checkpoint says what it is
    assert {name for name, cls in declared.items() if cls not in runnable} == set()  # LTX-2.3: the ltx2 family


# a release no family runs (none today: LTX-2.3 was one until the ltx2 family), as a test-local entry
UNRUNNABLE = R.HubAsset("Some-Video-1", "org/Some-Video-1-Diffusers", marker="model_index.json",
                        transformer_class="SomeVideoTransformer3DModel")


def test_a_full_scale_launch_of_a_checkpoint_no_family_runs_is_refused_before_anything_is_fetched(
        stand_ins, tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from miles.launcher.recipe_assets import ensure_assets

    monkeypatch.setitem(R.RELEASED_CHECKPOINTS, UNRUNNABLE.name, UNRUNNABLE)
    dirs = SimpleNamespace(model_dir=str(tmp_path / "models"), data_dir=str(tmp_path / "data"))
    with pytest.raises(SystemExit) as exit:
        ensure_assets("ltx2", SimpleNamespace(checkpoint_size=None), dirs, released=UNRUNNABLE.name, pickscore=True)
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "SomeVideoTransformer3DModel" in line and "LTX2VideoTransformer3DModel" in line
    assert "no family of this project runs" in line
    assert "--scale gpu-proxy" in line and "nothing was fetched" in line
    assert stand_ins() == []  # neither hf nor curl ran


def test_a_release_another_family_runs_is_refused_naming_that_family(tmp_path):
    from miles.launcher.recipe_assets import refuse_unrunnable_release

    with pytest.raises(R.UnrunnableCheckpointError, match="family `ltx2` runs it"):
        refuse_unrunnable_release("ltx", "LTX-2.3", tmp_path)
    refuse_unrunnable_release("ltx2", "LTX-2.3", tmp_path)  # the family that runs it: fetched as usual


def test_a_folder_of_that_name_under_model_dir_is_the_users_own_and_is_not_refused(tmp_path):
    from miles.launcher.recipe_assets import refuse_unrunnable_release

    with pytest.raises(R.UnrunnableCheckpointError, match="diffusers/LTX-2.3-Diffusers"):
        refuse_unrunnable_release("ltx", "LTX-2.3", tmp_path)  # LTX-Video's family, an LTX-2 release
    (tmp_path / "LTX-2.3").mkdir()
    refuse_unrunnable_release("ltx", "LTX-2.3", tmp_path)  # left to the preflight, which reads its config
    refuse_unrunnable_release("wan2_2", "Wan2.2-T2V-A14B-Diffusers", tmp_path / "nowhere")


def test_a_prepare_step_that_launches_nothing_still_fetches_as_it_ends(tmp_path):
    """Deferred downloads wait for a launch's checks; a process that launches nothing runs them at exit."""
    script = tmp_path / "prepare_only.py"
    script.write_text(
        "from miles.launcher.deferred_fetches import defer\n"
        f"defer('a file', lambda: open({str(tmp_path / 'fetched')!r}, 'w').write('x'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "fetched").read_text() == "x"


# stand-ins that fail as the real tools do offline: their own one line on stderr, a non-zero status
FAILING = {"curl": "echo 'curl: (6) Could not resolve host: raw.githubusercontent.com' >&2; exit 6",
           "hf": "echo 'hf: error: cannot reach huggingface.co' >&2; exit 1"}


def launch_multinode_with_failing_tool(tmp_path: Path, tool: str) -> subprocess.CompletedProcess:
    """The 17-GPU multi-node recipe's `train` role as a user runs it on the head (not dry, its default
    --scale full, a routable MASTER_ADDR), with `tool` failing on PATH; it must stop in its downloads."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / tool).write_text(f"#!/bin/bash\n{FAILING[tool]}\n")
    (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_SCRIPT_", "HF_", "WANDB_", "RAY_"))}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "HF_HOME": str(tmp_path / "hf-home"), "MASTER_ADDR": "192.0.2.10",
                "MILES_SCRIPT_ENABLE_RAY_SUBMIT": "1"})
    return subprocess.run([sys.executable, str(REPO / "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py"),
                           "--output-dir", str(tmp_path / "out"), "--model-dir", str(tmp_path / "models"),
                           "--data-dir", str(tmp_path / "data")], env=env, capture_output=True, text=True, timeout=60)


def ends_in_one_download_line(result: subprocess.CompletedProcess, tool: str) -> str:
    """Exit 2; stderr is the tool's own line and then ours, the last; no traceback; nothing planned."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2 and lines[0].startswith(f"{tool}: "), result.stderr
    assert lines[1].startswith("error: could not download ") and "; fix: " in lines[1]
    return lines[1]


def test_a_multinode_launch_whose_prompt_download_fails_ends_in_one_line_with_the_url_status_and_fix(tmp_path):
    line = ends_in_one_download_line(launch_multinode_with_failing_tool(tmp_path, "curl"), "curl")
    train = R.PROMPT_SETS["pickscore"][0]
    assert line.startswith(f"error: could not download prompt set {train.name} ({train.url}): curl exited 6 (could "
                           f"not resolve the host); fix: check this host's network")
    seed_at = tmp_path / "hf-home" / "miles-prompts" / "yifan123--flow_grpo" / train.commit / train.path
    assert f"put the file at {seed_at} (the launch then uses it from there" in line
    assert not list((tmp_path / "out").glob("*/plan.json"))  # stopped before the launch was planned


def test_a_multinode_launch_whose_checkpoint_download_fails_names_the_repo_status_token_and_cache(tmp_path):
    for item in R.PROMPT_SETS["pickscore"]:  # the prompt sets pre-seeded, as the first line advises
        seeded = tmp_path / "hf-home" / "miles-prompts" / item.repo.replace("/", "--") / item.commit / item.path
        seeded.parent.mkdir(parents=True, exist_ok=True)
        seeded.write_text("a prompt\n")
    line = ends_in_one_download_line(launch_multinode_with_failing_tool(tmp_path, "hf"), "hf")
    asset = R.RELEASED_CHECKPOINTS["Wan2.2-T2V-A14B-Diffusers"]
    assert f"could not download {asset.repo_id}@main: `hf download {asset.repo_id}" in line and "exited 1" in line
    assert "HF_TOKEN" in line and f"copy {tmp_path / 'hf-home' / 'hub' / asset.cache_folder} to the same path" in line
