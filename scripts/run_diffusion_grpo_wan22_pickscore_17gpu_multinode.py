"""Flow-GRPO with PickScore on Wan2.2 A14B, full finetune of both experts, on 17 GPUs over 3 nodes.

What it trains:
    Both Wan2.2 experts (`transformer` for the high-noise steps, `transformer_2` for the rest,
    switching at t = 0.875 x 1000), every weight, with Flow-GRPO; each video is scored by
    PickScore (the mean over a few of its frames). The 2-step SDE window may start anywhere up
    to the last steps, so a rollout can train either expert or both; each forward holds one
    pair (`--micro-batch-size 1`), so no forward ever mixes the experts.

Prerequisites:
    --scale full: on every node, `<model-dir>/Wan2.2-T2V-A14B-Diffusers` (diffusers layout)
    and `<model-dir>/PickScore_v1`, plus the repo and the same --data-dir (a shared filesystem).

GPU layout (--scale full, 3 nodes, 17 GPUs):
    node 0, 1   8 GPUs each: one train rank + one rollout engine per GPU (colocated), 16 DP ranks
    node 2      1 GPU: PickScore, 4 reward workers at 0.25 GPU each. They ask for a GPU fraction
                and no --colocate-reward, so Ray places them on the only GPU left free.
    --num-nodes N spans N nodes: N - 1 train nodes of 8 GPUs and the reward node.

Scales (--scale):
    full       Wan2.2 A14B and PickScore, 480x832 px x 33 frames, 16 prompts x 16 samples, 17 GPUs
               eval: 64 held-out prompts every 100 rollouts, none before training
    gpu-proxy  the CI proxy: our proxy-size wan2_2 and a tiny CLIP on ONE node of 4 GPUs
               (3 train ranks + engines colocated, 1 PickScore GPU), 256 px x 9 frames
    cpu-proxy  our tiny wan2_2 and tiny CLIP, 64 px x 5 frames, 2 CPU train ranks, CPU reward actor

Two ways to bring the cluster up (each node: `ulimit -n 1000000` first; a raylet inheriting
1024 open files dies later with a misleading "Socket closed"):

  A. You build it, the launcher only submits (MILES_SCRIPT_EXTERNAL_RAY=1); every node with the
     cluster's token (export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/shared/ray_token first):
       head:        CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ray start --head --port 6379 --num-gpus 8
       train node:  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ray start --address <head-ip>:6379 --num-gpus 8
       reward node: CUDA_VISIBLE_DEVICES=0 ray start --address <head-ip>:6379 --num-gpus 1
       then, on the head:
       MILES_SCRIPT_EXTERNAL_RAY=1 RAY_ADDRESS=http://<head-ip>:8265 RAY_AUTH_TOKEN_PATH=/shared/ray_token \\
           python3 scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py train
     (CUDA_VISIBLE_DEVICES must be in each `ray start`'s own environment; the launcher refuses
     --cuda-visible-devices with an external cluster.)

  B. One command per node role, the launcher starts the head itself:
       head:        MASTER_ADDR=<head-ip> python3 scripts/run_..._17gpu_multinode.py train --output-dir /shared/logs
       train node:  RAY_AUTH_TOKEN_PATH=/shared/logs/<run-id>/ray_auth_token \\
                        python3 scripts/run_..._17gpu_multinode.py worker --head-address <head-ip>:6379 --num-gpus 8
       reward node: RAY_AUTH_TOKEN_PATH=/shared/logs/<run-id>/ray_auth_token \\
                        python3 scripts/run_..._17gpu_multinode.py worker --head-address <head-ip>:6379 --num-gpus 1
     The head requires its own fresh token (its file's path is printed when it starts); a worker
     joins with it, and blocks until interrupted or the head goes away.

Either way `train` submits only once the cluster reports every node and GPU (train nodes x 8 +
the reward GPU). With no role word the script runs `train`, like every other recipe.

Example:
    MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 python3 scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py --output-dir /tmp/dry
    python3 scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py --scale gpu-proxy --cuda-visible-devices 0,1,2,3
    python3 scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py --scale cpu-proxy
Resume a killed run: the same --run-id plus --extra-args "--load <output-dir>/<run-id>/checkpoints".
Use what it trained: python3 -m miles.export <output-dir>/<run-id> --out DIR (docs/using-what-you-trained.md).
"""

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import miles.launcher.recipe_api as U

FAMILY = "wan2_2"
# the H200 141GB GPUs this recipe is laid out for; the memory plan checks its estimate against them
GPU_MEMORY_GB = 141
RELEASED_CHECKPOINT = "Wan2.2-T2V-A14B-Diffusers"  # under --model-dir (--scale full), beside PickScore_v1
ROLES = ("worker", "train")


@dataclass(frozen=True, kw_only=True)
class _Scale(U.RolloutScale):
    num_nodes: int  # default for --num-nodes: the nodes the job spans, the reward node included
    train_gpus_per_node: int  # GPUs (CPU slots on cpu), each holding a train rank and a rollout engine
    reward_node: bool  # True: the reward GPU is a node of its own; False: on the train node
    height: int
    width: int
    frames: int  # 4k + 1 for the Wan VAE
    sde_window_max_start: int  # the 2-step SDE window starts in 0..sde_window_max_start


_SCALES: dict[str, _Scale] = {
    "full": _Scale(
        U.FULL_SCALE, num_nodes=3, train_gpus_per_node=8, reward_gpus=1, reward_node=True, height=480, width=832,
        frames=33, num_steps=20, sde_window_max_start=16, rollout_batch_size=16, n_samples_per_prompt=16,
        rm_num_workers=4, num_prompts=4000, num_rollout=200, eval_interval=100, eval_prompts=64, save_interval=10, sharded=True,
    ),
    "gpu-proxy": _Scale(
        U.GPU_PROXY, num_nodes=1, train_gpus_per_node=3, reward_gpus=1, reward_node=False, height=256, width=256,
        frames=9, num_steps=10, sde_window_max_start=8, rollout_batch_size=3, n_samples_per_prompt=4,
        rm_num_workers=4, num_prompts=64, num_rollout=4,
    ),
    # the GPU check's Wan2.2 full fine-tune (ci/gpu_check.sh): rank, engine and PickScore share one GPU
    "1gpu-proxy": _Scale(
        U.GPU_PROXY, num_nodes=1, train_gpus_per_node=1, reward_gpus=0.25, colocate_reward=True, reward_node=False,
        height=256, width=256, frames=9, num_steps=10, sde_window_max_start=8, rollout_batch_size=2,
        n_samples_per_prompt=4, rm_num_workers=1, num_prompts=64, num_rollout=2,
    ),
    "cpu-proxy": _Scale(
        U.CPU_PROXY, num_nodes=1, train_gpus_per_node=2, reward_gpus=0, reward_node=False, height=64, width=64,
        frames=5, num_steps=6, sde_window_max_start=4, rollout_batch_size=2, n_samples_per_prompt=4,
        rm_num_workers=1, num_prompts=16, num_rollout=2,
    ),
}
# the GPU case's settings on CPU slots at the CPU proxy's size (issue 39: all but the device)
_SCALES["cpu-rehearsal"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["gpu-proxy"])
# the full run's train backend (FSDP2 over the ranks, both sides offloaded) on CPU slots
_SCALES["cpu-rehearsal-fsdp"] = U.rehearsal_scale(_SCALES["cpu-proxy"], _SCALES["full"])


@dataclass
class ScriptArgs(U.ScaledRecipeArgs):
    num_nodes: Optional[int] = field(
        default=None,
        metadata={"help": "Nodes the job spans; unset: 3 at --scale full (2 train nodes of 8 GPUs + the reward "
                          "node), 1 for the proxies (the reward GPU on the train node)."},
    )
    scale: Literal["full", "gpu-proxy", "1gpu-proxy", "cpu-proxy", "cpu-rehearsal", "cpu-rehearsal-fsdp"] = U.scale_option(
        "full: Wan2.2 A14B on 2 nodes x 8 GPUs + 1 reward GPU; gpu-proxy: our proxy-size wan2_2 "
        "on one node of 4 GPUs (the CI proxy); 1gpu-proxy: the same on one GPU (the GPU check); cpu-proxy: our "
        "tiny wan2_2 on CPU slots; cpu-rehearsal(-fsdp): the GPU proxy's (the full run's) settings on CPU slots.")
    num_rollout: Optional[int] = U.num_rollout_option(_SCALES)
    head_port: int = field(
        default=6379,
        metadata={"help": "GCS port of the Ray head `train` starts for a multi-node job (workers join "
                          "<head-ip>:<port>); unused with MILES_SCRIPT_EXTERNAL_RAY=1 or on one node."},
    )


@dataclass
class WorkerArgs:
    head_address: str = field(
        default="127.0.0.1:6379", metadata={"help": "The Ray head to join, host:gcs_port (see `train --head-port`)."}
    )
    num_gpus: int = field(
        default=8, metadata={"help": "GPUs this node offers: 8 for a train node, 1 for the reward node."}
    )
    node_ip: str = field(
        default="",
        metadata={"help": "This node's address as the others reach it (empty: Ray finds it; loopback for a "
                          "loopback head)."},
    )
    cuda_visible_devices: str = field(
        default="", metadata={"help": "Physical GPUs this node offers, e.g. 0 (empty: inherit CUDA_VISIBLE_DEVICES)."}
    )
    output_dir: str = field(
        default=str(U.REPO_ROOT / "logs"), metadata={"help": "Where this node's launch record is kept (for cleanup)."}
    )


def prepare(args: ScriptArgs) -> U.Assets:
    return U.ensure_assets(FAMILY, _SCALES[args.scale], args, released=RELEASED_CHECKPOINT, pickscore=True)


def execute(args: ScriptArgs, assets: U.Assets) -> None:
    scale = _SCALES[args.scale]
    job_nodes = args.num_nodes or scale.num_nodes
    train_nodes = job_nodes - (1 if scale.reward_node else 0)
    if train_nodes < 1:
        raise SystemExit(f"error: --num-nodes {job_nodes} leaves no train node: --scale {args.scale} puts the "
                         f"reward GPU on a node of its own; give at least 2")
    reward_gpus = scale.separate_reward_gpus  # none beyond the train GPUs when the reward shares them
    gpus_per_node = scale.train_gpus_per_node + (0 if scale.reward_node else reward_gpus)
    total_gpus = train_nodes * scale.train_gpus_per_node + reward_gpus

    def wait_for_every_node(cluster: U.ClusterInfo) -> None:
        """Submit only once the train nodes and the reward GPU have all joined."""
        U.wait_for_cluster_resources(
            cluster.job_server_url, num_nodes=job_nodes, num_gpus=scale.ray_gpus(total_gpus),
        )

    job = U.colocated_job(
        __file__, dataclasses.replace(args, num_nodes=job_nodes), assets, FAMILY, scale, GPU_MEMORY_GB,
        train_gpus=scale.train_gpus_per_node, gpus_per_node=gpus_per_node, train_nodes=train_nodes, job_nodes=job_nodes,
        before_ray_job_submit=wait_for_every_node, ray_head_port=args.head_port if job_nodes > 1 else None,
    )

    rollout_args = U.rollout_batch_args(assets.prompt_data, scale, args.num_rollout) + (
        f"--diffusion-height {scale.height} --diffusion-width {scale.width} "
        f"--diffusion-output-num-frames {scale.frames} "
        f"--diffusion-num-steps {scale.num_steps} --diffusion-num-sde-steps 2 "
        "--diffusion-step-strategy-path sde_window "
        f"--diffusion-sde-window-max-start {scale.sde_window_max_start} "  # may cross the expert boundary
        "--diffusion-sde-type sde --diffusion-noise-level 0.7 "
        "--diffusion-guidance-scale 4.0 --diffusion-guidance-scale-2 3.0 "  # high-noise, low-noise expert
    )

    grpo_args = U.flow_grpo_args()

    optimizer_args = U.optimizer_args(lr="5e-6")

    lora_args = ""  # full finetune of both experts

    train_backend_args = U.train_backend_args(scale.dtype, update_weights="transformer transformer_2",
                                                sharded=scale.sharded)

    # one pair per forward: one expert
    # one pair per forward; the engines sample one sample at a time, so each train forward is one they ran
    perf_args = U.flat_micro_batch_args(1) + "--rollout-microgroup-size 1 " + U.gradient_checkpointing_args(scale)

    job.execute_train(rollout_args=rollout_args, grpo_args=grpo_args, optimizer_args=optimizer_args,
                      lora_args=lora_args, train_backend_args=train_backend_args, perf_args=perf_args)


@U.dataclass_cli
def worker(args: WorkerArgs) -> None:
    """Join the Ray head as a train node (--num-gpus 8) or the reward node (--num-gpus 1); block."""
    status = U.start_ray_worker(
        args.head_address, output_dir=args.output_dir, num_gpus=args.num_gpus,
        cuda_visible_devices=args.cuda_visible_devices or None, node_ip=args.node_ip or None,
    )
    raise SystemExit(status)


@U.dataclass_cli
def main(args: ScriptArgs) -> None:
    """Role `train` (also what runs with no role word): wait for every node and GPU, then submit.

    The other role, `worker`, joins a node to the cluster: see `<this script> worker --help`.
    """
    execute(args, prepare(args))


if __name__ == "__main__":
    role = sys.argv.pop(1) if sys.argv[1:2] and sys.argv[1] in ROLES else "train"
    worker() if role == "worker" else main()
