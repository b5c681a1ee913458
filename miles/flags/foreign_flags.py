"""miles-diffusion's flags that do not run here: those with no counterpart (what each tunes, and
why that does not run here) and the refused ones (what runs here instead). The data of
flag_vocabulary's rule, apart from its reading of our parser, so that the parser's own message for an
unknown flag (public_flags) can name them. Torch-free.
"""

from __future__ import annotations

SAME, MAPPED, NO_COUNTERPART, REFUSED = "same", "mapped", "no counterpart", "refused"

_SERVER = "miles-diffusion's sglang servers do not run here: rollout is this project's engines, which run the train ranks' forward"
_ROUTER = ("the miles router does not run here: the driver hands each engine its prompt groups directly "
           "(miles.ray.rollout_manager)")
_PARSER = "the parsing of sglang server responses does not run here: engines hand back tensors"
_ONE_GPU = ("an engine here runs on one GPU (--rollout-num-gpus-per-engine 1; more engines, not bigger ones); "
            "fix: 1, or drop the flag")

# flag -> why it has no counterpart (what it tunes, and why that does not run here)
NO_COUNTERPART: dict[str, str] = {
    "--use-miles-router": _ROUTER,
    "--miles-router-health-check-failure-threshold": f"router health checks; {_ROUTER}",
    "--rollout-health-check-interval": f"engine server health checks; {_SERVER} (a stuck engine is caught by "
                                       f"--remote-timeout-*)",
    "--sglang-server-concurrency": f"requests an sglang server runs at once (speed); {_SERVER}",
    "--sglang-attention-backend": f"the sglang server's attention kernel (speed); {_SERVER}",
    "--sglang-vae-slicing": f"sglang VAE slicing (memory); {_SERVER}",
    "--sglang-vae-cpu-offload": f"sglang VAE offload (memory); {_SERVER}",
    "--sglang-text-encoder-cpu-offload": f"sglang text encoder offload (memory); {_SERVER}",
    "--sglang-cpu-offload-components": f"sglang component offload (memory); {_SERVER}",
    "--sglang-model-id": f"the name an sglang server serves its model under; {_SERVER}",
    "--sglang-tp-size": f"an sglang server's tensor parallelism, 1 here; {_SERVER}",
    "--sglang-sp-degree": f"an sglang server's sequence parallelism, 1 here; {_SERVER}",
    "--sglang-ulysses-degree": f"an sglang server's Ulysses degree, 1 here; {_SERVER}",
    "--sglang-ring-degree": f"an sglang server's ring-attention degree, 1 here; {_SERVER}",
    "--rollout-parser-num-workers": f"workers parsing server responses (speed); {_PARSER}",
    "--rollout-fetch-in-parser": f"where server responses are fetched (speed); {_PARSER}",
}
# no-counterpart flags whose only value here is 1 (what an engine of ours is); another is refused
ONE_ONLY = ("--sglang-tp-size", "--sglang-sp-degree", "--sglang-ulysses-degree", "--sglang-ring-degree")

_REWARDS = "rewards here: --rm-type (a built-in: brightness, color_match, ocr, pickscore) or --custom-rm-path pkg.mod:fn"
_H3 = "MiniMax-H3 does not run here (no family of this project runs it; --diffusion-model-family lists those)"
# flag (or prefix ending in '-') -> what runs here instead
REFUSED: dict[str, str] = {
    "--hps-": f"the HPS reward does not run here; {_REWARDS}",
    "--api-rm-config": f"API rewards (a remote model scoring images) do not run here; {_REWARDS}",
    "--custom-rm-args": f"miles-diffusion's weighted reward mixture does not run here; {_REWARDS}",
    "--fsdp-attention-backend": "train ranks here run the diffusers attention the engines run (their forwards are one "
                                "code path, parity exact); no other kernel is chosen; drop the flag",
    "--fsdp-cpu-offload": "FSDP's CPU offload does not run here; with --colocate, --offload-train keeps the train "
                          "state in host memory between train steps",
    "--sft-offload-encoder": "SFT here encodes items with --hf-checkpoint's own VAE and text encoder on the train "
                             "ranks; there is no encoder pool to drop between rounds",
    "--diffusion-audio-flow-shift": _H3,
    "--diffusion-h3-": _H3,
    "--wan-controlnet-": "a Wan ControlNet branch does not run here (no family of this project trains one)",
}


def _matches(flag: str, table: dict[str, str]) -> str | None:
    for name, why in table.items():
        if flag == name or (name.endswith("-") and flag.startswith(name)):
            return why
    return None


def refusal(flag: str) -> str | None:
    """What runs here instead of a refused flag, or None."""
    return _matches(flag.split("=", 1)[0], REFUSED)
