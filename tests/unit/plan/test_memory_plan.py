"""The dry run's memory plan (miles/plan/memory_plan.py): facts from safetensors headers or the
committed table, the per-role estimate, and the refusal that names role, estimate, budget and fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.flags.arguments import ConfigError, parse_and_plan
from miles.plan.command_line import parse_command_line
from miles.plan.memory_plan import (
    GIB, MemoryPlanError, build_memory_plan, model_facts, plan_and_check, read_checkpoint, safetensors_params,
)

REPO = Path(__file__).resolve().parents[3]

# the Wan2.2 LoRA recipe's batch and layout, on H200s; the checkpoint resolves through the committed table
WAN = ["--hf-checkpoint", "/nowhere/Wan2.2-T2V-A14B-Diffusers", "--num-rollout", "2", "--rm-type", "brightness",
       "--prompt-data", "p.jsonl", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
       "--diffusion-height", "480", "--diffusion-width", "832", "--diffusion-output-num-frames", "33",
       "--diffusion-num-steps", "20", "--diffusion-num-sde-steps", "2", "--diffusion-guidance-scale-2", "3.0",
       "--micro-batch-size", "1", "--rollout-microgroup-size", "1", "--gradient-checkpointing", "--param-dtype", "bfloat16",
       "--compute-dtype", "bfloat16", "--rollout-dtype", "bfloat16", "--actor-num-gpus-per-node", "4",
       "--num-gpus-per-node", "4", "--colocate", "--update-weight-target-module", "transformer"]
SD3 = ["--hf-checkpoint", "/nowhere/stable-diffusion-3.5-medium", "--num-rollout", "2", "--rm-type", "brightness",
       "--prompt-data", "p.jsonl", "--rollout-batch-size", "16", "--n-samples-per-prompt", "16",
       "--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "1", "--rollout-microgroup-size", "8",
       "--gradient-checkpointing",
       "--compute-dtype", "bfloat16", "--rollout-dtype", "bfloat16", "--actor-num-gpus-per-node", "2",
       "--num-gpus-per-node", "2", "--colocate", "--use-lora", "--gpu-memory-gb", "80"]


def memory(argv):
    ns, plan = parse_and_plan(argv)
    return build_memory_plan(ns, plan)


def test_a_lora_recipe_fits_and_the_plan_shows_every_role_and_term():
    plan = memory(SD3)
    text = plan.table()
    assert plan.over_budget() == [] and plan.available
    for expected in ("committed table (stable-diffusion-3.5-medium)", "train GPU:", "train rank:", "engine:",
                     "master model", "compute copy in bfloat16", "trained state LoRA rank 32", "activations:",
                     "pipeline 7.91 B params in bfloat16", "budget 72.0 = --gpu-memory-gb 80 minus 10% headroom",
                     "sharding factor 1"):
        assert expected in text, (expected, text)


def test_full_parameter_wan_refuses_naming_role_estimate_budget_and_fix(capsys):
    argv = [*WAN, "--gpu-memory-gb", "141", "--update-weight-target-module", "transformer", "transformer_2"]
    with pytest.raises(MemoryPlanError) as err:
        plan_and_check(*parse_and_plan(argv))
    message = str(err.value)
    assert "memory plan: each train GPU needs an estimated" in message
    assert "train rank" in message and "engine" in message  # colocated: both roles on the GPU
    assert "over its budget of 126.9 GiB (--gpu-memory-gb 141 minus 10% headroom)" in message
    assert "--use-lora" in message and "--update-weight-target-module transformer" in message
    # train_diffusion.py refuses it at parse time, after printing the batch plan
    with pytest.raises(SystemExit) as code:
        parse_command_line(argv)
    assert code.value.code == 1
    assert "memory plan: each train GPU" in capsys.readouterr().err


def test_gpu_memory_gb_decides_the_verdict():
    lora = [*WAN, "--use-lora"]
    assert memory([*lora, "--gpu-memory-gb", "1000"]).over_budget() == []
    small = memory([*lora, "--gpu-memory-gb", "40"])
    assert [g.name for g in small.over_budget()] == ["train GPU"]
    assert small.budget_gib == pytest.approx(36.0)


def test_gpu_memory_gb_is_refused_on_the_cpu():
    argv = ["--hf-checkpoint", "/ckpt/sd3-tiny", "--num-rollout", "2", "--rm-type", "brightness",
            "--prompt-data", "p.jsonl", "--device", "cpu", "--gpu-memory-gb", "80"]
    with pytest.raises(ConfigError, match="--gpu-memory-gb 80 with --device cpu"):
        parse_and_plan(argv)


def test_an_unknown_checkpoint_gives_unavailable_not_a_guess():
    plan = memory([*SD3[:1], "/nowhere/sd3-something-else", *SD3[2:]])
    assert not plan.available and plan.over_budget() == []
    assert "estimate unavailable" in plan.table()


def test_sharing_a_gpu_adds_the_engine_and_more_pairs_per_forward_add_activations():
    colocated = memory(SD3)
    separate = memory([*SD3, "--no-colocate", "--rollout-num-gpus", "1", "--num-gpus-per-node", "3"])
    assert [g.name for g in separate.gpus] == ["train GPU", "rollout GPU"]
    # colocated, the rank also keeps the IPC push's one buffer (the LoRA update, under one bucket)
    ipc = dict(colocated.gpus[0].roles[0].terms)[IPC_TERM]
    assert 0 < ipc <= 512 * 1024 ** 2
    assert colocated.gpus[0].total == pytest.approx(separate.gpus[0].total + separate.gpus[1].total + ipc)
    bigger = memory([*SD3, "--micro-batch-size-sample", "16", "--rollout-microgroup-size", "16"])
    assert bigger.gpus[0].total > colocated.gpus[0].total


def test_wan_vae_is_planned_in_float32_in_the_engine_weights_and_decode_maps():
    from miles.plan.model_facts import model_facts

    vae = model_facts(WAN[1]).components["vae"].params
    every = sum(f.params for f in model_facts(WAN[1]).components.values())
    engine = {what.split(" (")[0]: b for what, b in memory(WAN).gpus[0].roles[1].terms}
    assert engine["pipeline 34.38 B params in bfloat16"] == every * 2 + vae * 2  # the VAE's 4 bytes a parameter
    fp32 = {what.split(" (")[0]: b for what, b in memory([*WAN, "--rollout-dtype", "float32", "--compute-dtype",
                                                          "float32", "--param-dtype", "float32"]).gpus[0].roles[1].terms}
    decode = [k for k in engine if k.startswith("VAE decode")]
    assert decode and engine[decode[0]] == fp32[decode[0]]  # decoded in float32 whatever --rollout-dtype
    sd3 = {what.split(" (")[0]: b for what, b in memory(SD3).gpus[0].roles[1].terms}
    sd3_fp32 = {what.split(" (")[0]: b for what, b in memory([*SD3, "--rollout-dtype", "float32", "--compute-dtype",
                                                              "float32", "--param-dtype", "float32"]).gpus[0].roles[1].terms}
    sd3_decode = [k for k in sd3 if k.startswith("VAE decode")][0]
    assert sd3[sd3_decode] * 2 == sd3_fp32[sd3_decode]  # SD3's VAE follows --rollout-dtype
    # the label says so where the part's dtype differs from the term's, and only there
    assert "pipeline 34.38 B params in bfloat16 (vae in float32)" in memory(WAN).table()
    assert "(vae in float32)" not in memory([*WAN, "--rollout-dtype", "float32", "--compute-dtype", "float32",
                                             "--param-dtype", "float32"]).table()


def train_terms(plan) -> dict[str, float]:
    rank = plan.gpus[0].roles[0]
    assert rank.role == "train rank"
    return {what.split(":")[0].split(" (")[0]: b for what, b in rank.terms}


def test_fsdp_divides_master_weights_grads_and_adam_state_by_the_train_ranks_and_gathers_one_block():
    full = [*WAN, "--param-dtype", "float32"]  # full-parameter Wan2.2 transformer, fp32 master, bf16 compute
    dp = memory(full)
    two, four = (memory([*full, "--train-backend", "fsdp", "--actor-num-gpus-per-node", str(n),
                         "--num-gpus-per-node", str(n)]) for n in (2, 4))
    assert "sharding factor 4 (--train-backend fsdp" in four.table() and "sharding factor 1" in dp.table()
    t2, t4 = train_terms(two), train_terms(four)
    master = [k for k in t4 if k.startswith("master model")][0]
    state = [k for k in t4 if k.startswith("trained state")][0]
    assert t2[master] == pytest.approx(2 * t4[master]) and t2[state] == pytest.approx(2 * t4[state])
    # trained state per parameter: reduce-scattered grad + AdamW's two states, fp32, over 4 ranks
    params = 14.29e9  # the committed table's Wan2.2 A14B transformer, about
    assert t4[state] == pytest.approx(params * 12 / 4, rel=0.01)
    gathered = [k for k in t4 if k.startswith("one all-gathered block")][0]
    assert 0 < t4[gathered] < t4[master] / 4  # one of 40 blocks and its grad, in bf16
    assert not any(k.startswith("compute copy") for k in t4)  # fsdp casts in the all-gather
    assert four.gpus[0].total < dp.gpus[0].total / 2
    assert "--train-backend fsdp" in " ".join(dp.gpus[0].knobs)


def test_sharded_lora_plans_the_frozen_base_in_the_compute_dtype_and_only_the_adapters_in_float32():
    fsdp = [*WAN, "--train-backend", "fsdp", "--param-dtype", "float32"]
    full_terms, lora_terms = train_terms(memory(fsdp)), train_terms(memory([*fsdp, "--use-lora"]))
    full, lora = full_terms["master model"], lora_terms["master model"]
    labels = [what for what, _ in memory([*fsdp, "--use-lora"]).gpus[0].roles[0].terms]
    assert any("in bfloat16 (base) and float32 (LoRA)" in what for what in labels)
    adapters = [v for k, v in lora_terms.items() if k.startswith("trained state")][0] / 3  # grad + 2 AdamW, fp32
    # the base at 2 bytes instead of 4 (the full-parameter master is the base alone, in fp32)
    assert lora == pytest.approx(full / 2 + adapters, rel=1e-6)


def test_offload_makes_the_peak_the_largest_phase_not_the_sum_of_the_roles():
    fsdp = [*WAN, "--train-backend", "fsdp"]
    resident = memory(fsdp).gpus[0]
    both = memory([*fsdp, "--offload-train", "--offload-rollout"]).gpus[0]
    train, engine = both.roles[0], both.roles[1]
    assert resident.phases == {} and resident.total == pytest.approx(train.total + engine.total)
    assert set(both.phases) == {"training", "rollout", "weight sync"}
    assert both.phases["training"] == pytest.approx(train.total + engine.total - engine.models - engine.activations)
    assert both.phases["rollout"] == pytest.approx(
        engine.total + train.total - train.activations - train.models - train.optimizer_state)
    assert both.total == max(both.phases.values()) < resident.total
    text = memory([*fsdp, "--offload-train", "--offload-rollout"]).table()
    assert "peak of the phases (offload): training" in text
    # one flag alone leaves a phase with both sides' weights resident
    only_train = memory([*fsdp, "--offload-train"]).gpus[0]
    assert only_train.phases["training"] == pytest.approx(train.total + engine.total - engine.activations)
    assert both.total < only_train.total


IPC_TERM = "IPC push buffer, reused by every push (the largest bucket; the engine stages nothing)"


def test_colocated_the_ipc_push_stages_nothing_on_the_engine_and_one_reused_bucket_on_the_rank():
    from miles.plan.memory_plan import phase_plan

    bucket = 512 * 1024 ** 2  # the default --update-weight-buffer-size; Wan2.2's full update is far larger
    rank = memory(WAN).gpus[0].roles[0]
    assert dict(rank.terms)[IPC_TERM] == bucket
    gone = memory([*WAN, "--weight-sync", "object-store"]).gpus[0].roles[0]  # no buckets: no buffer
    assert IPC_TERM not in dict(gone.terms) and rank.total - gone.total == pytest.approx(bucket)
    ns, plan = parse_and_plan(WAN)
    phases = phase_plan(ns, plan).gpus["train GPU"]
    ns2, plan2 = parse_and_plan([*WAN, "--weight-sync", "object-store"])
    store = phase_plan(ns2, plan2).gpus["train GPU"]
    # the engine copies out of the rank's buffer: the push holds one bucket, not one on each side;
    # the buffer stays for every later phase (it is made once, when the push path forms)
    assert phases["weight push"] - store["weight push"] == pytest.approx(bucket)
    for phase in ("train", "checkpoint save", "rollout"):
        assert phases[phase] - store[phase] == pytest.approx(bucket), phase
    assert phases["setup"] == store["setup"]


def test_the_weight_sync_phase_holds_the_engine_what_the_update_reads_and_the_ranks_one_buffer():
    offloaded = [*WAN, "--train-backend", "fsdp", "--offload-train", "--offload-rollout"]
    full, lora = memory(offloaded).gpus[0], memory([*offloaded, "--use-lora"]).gpus[0]
    mib = 256
    small = memory([*offloaded, "--update-weight-buffer-size", str(mib * 1024 ** 2)]).gpus[0]
    store = memory([*offloaded, "--weight-sync", "object-store"]).gpus[0]
    engine = full.roles[1]
    # the sharded trained transformer (bf16, 1/4 of ~14.3 B params) comes back, nothing else of the rank
    shard = 14.29e9 * 2 / 4
    # colocated: the IPC push, one buffer on the rank and nothing staged by the engine
    assert full.phases["weight sync"] - store.phases["weight sync"] == pytest.approx(512 * 1024 ** 2)
    assert store.phases["weight sync"] == pytest.approx(engine.total - engine.activations + shard + GIB, rel=0.01)
    assert full.phases["weight sync"] - small.phases["weight sync"] == pytest.approx((512 - mib) * 1024 ** 2)
    # LoRA: only the adapters, far less than the shard
    assert lora.phases["weight sync"] < full.phases["weight sync"] - shard / 2
    # without --offload-train the rank's models stay whole through the sync
    kept = memory([*WAN, "--train-backend", "fsdp", "--offload-rollout"]).gpus[0]
    assert kept.phases["weight sync"] > full.phases["weight sync"] + full.roles[0].models - shard - GIB


def test_parameters_come_from_safetensors_headers_without_reading_weights(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    ckpt = tmp_path / "my-sd3"
    (ckpt / "transformer").mkdir(parents=True)
    (ckpt / "vae").mkdir()
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, str(ckpt / "transformer" / "x-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, str(ckpt / "transformer" / "x-2.safetensors"))
    save_file({"d": torch.zeros(4)}, str(ckpt / "vae" / "diffusion_pytorch_model.safetensors"))
    (ckpt / "transformer" / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 3}))
    assert safetensors_params(ckpt / "transformer" / "x-1.safetensors") == 22
    facts = read_checkpoint(ckpt)
    assert facts.source == "checkpoint on disk"
    assert facts.components["transformer"].params == 30 and facts.components["vae"].params == 4
    assert (facts.components["transformer"].hidden, facts.components["transformer"].blocks) == (64, 3)
    assert model_facts(str(ckpt)).components["transformer"].params == 30  # disk wins over the table


def test_our_own_checkpoints_resolve_by_name_through_the_table():
    facts = model_facts("/anywhere/miles-wan2_2-proxy-seed0")
    assert facts.source == "committed table (miles-wan2_2-proxy)"
    assert set(facts.components) == {"transformer", "transformer_2", "text_encoder", "vae"}


def test_the_dry_path_imports_no_torch():
    code = ("import sys; from miles.flags.arguments import parse_and_plan; "
            "from miles.plan.memory_plan import build_memory_plan; "
            f"ns, p = parse_and_plan({SD3!r}); build_memory_plan(ns, p); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_committed_table_is_what_the_configs_compute():
    """model_sizes.json holds counts computed on the meta device from the configs in model_table.py
    (released ones transcribed from their config.json; ours from create_checkpoint's sizes)."""
    pytest.importorskip("torch")
    from miles.models.size_table import _count
    from miles.plan.model_table import RELEASED, load_table

    table = load_table()
    for key, spec in RELEASED.items():
        for name, component in spec["components"].items():
            assert _count(component) == table[key]["components"][name], (key, name)
    # the published sizes, to the first digits: Wan2.2 A14B experts 14.3 B, Qwen-Image 20.4 B
    wan = table["Wan2.2-T2V-A14B-Diffusers"]["components"]["transformer"]["params"]
    assert wan / 1e9 == pytest.approx(14.29, abs=0.01)
    assert table["Qwen-Image"]["components"]["transformer"]["params"] / 1e9 == pytest.approx(20.43, abs=0.01)
    assert GIB == 2 ** 30
