"""Load a diffusers-layout checkpoint (ours or a released one) into a `DiffusionModel`.

`DiffusionModel.velocity` is the one forward both the rollout engine and the trainer call. It
runs a whole batch in one transformer call per expert, with the negative prompt laid out as the
family's diffusers pipeline lays it out (`FamilyModule.cfg_in_one_call`). A forward's last bits
depend on its inputs and on its shapes (a oneDNN convolution or a Linear at batch 1 and at batch 2
round differently), not on whether autograd is recording: so the trainer reproduces an engine's
output bit for bit by calling this with exactly the batch the engine used, the samples of one
microgroup at one step in the engine's order (the batch plan's rollout tile,
`miles.flags.batching`).
"""

from __future__ import annotations

import contextlib

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from miles.models.precision import cast_to_rule
from miles.models.runtime import quiet_libraries
from miles.models.registry import FamilySpec, detect_family, get_family
from miles.models.conditioning import Conditioning
from miles.records.checkpoint_layout import class_path, is_diffusers_library
from miles.utils.dotted_path import DottedPathError, load_callable
from miles.utils.import_cost import collector_paused
from miles.diffusion_facts.families import get_family_facts
from miles.diffusion_facts.schedule import (
    calculate_shift, edm_flow_sigmas, expert_index_for_step, flow_match_config, flow_match_sigmas,
)

logger = logging.getLogger(__name__)
SCHEDULER = "scheduler"  # the component whose config holds the sigma schedule


class CheckpointError(ValueError):
    pass


def _file_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _check_shapes(name: str, folder: Path, module: torch.nn.Module) -> None:
    """Name the first tensor whose stored shape differs from what the config builds."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    for key, shape in _file_shapes(folder).items():
        if key in expected and expected[key] != shape:
            raise CheckpointError(
                f"component {name!r}: tensor {key!r} has shape {list(shape)} in {folder}, "
                f"but its config.json builds {list(expected[key])}"
            )


def _component_class(name: str, library: str, class_name: str):
    # here rather than at import: the trainer's driver imports this module (with the actor classes)
    # and never loads a model; diffusers and transformers take it 2 s to import
    quiet_libraries()
    try:
        return load_callable(class_path(library, class_name), f"component {name!r}: class")
    except DottedPathError as e:
        raise CheckpointError(str(e)) from e


def _load_component(name: str, library: str, class_name: str, folder: Path, dtype: torch.dtype):
    cls = _component_class(name, library, class_name)
    kwargs = {}
    if issubclass(cls, torch.nn.Module):
        # load straight into the wanted dtype; diffusers and transformers name the argument differently
        kwargs = {"torch_dtype": dtype} if is_diffusers_library(library) else {"dtype": dtype}
    try:
        loaded = cls.from_pretrained(str(folder), **kwargs)
    except Exception as e:  # the libraries raise many kinds; say which component failed
        shapes_hint = ""
        if hasattr(cls, "from_config") or hasattr(cls, "config_class"):
            shapes_hint = " (a tensor shape that does not match config.json is a common cause)"
        raise CheckpointError(f"component {name!r} in {folder} failed to load{shapes_hint}: {e}") from e
    if isinstance(loaded, torch.nn.Module):
        _check_shapes(name, folder, loaded)
        loaded.eval().requires_grad_(False)
    return loaded


def _empty_component(name: str, library: str, class_name: str, folder: Path, dtype: torch.dtype):
    """The component built from its config.json with every parameter on the meta device (no bytes),
    its buffers computed on the host as `from_pretrained` computes them: a sharded trainer fills
    each rank's rows later (miles.backends.sharded_load), so no rank ever holds the whole weights."""
    cls = _component_class(name, library, class_name)
    if not is_diffusers_library(library) or not hasattr(cls, "from_config"):
        raise CheckpointError(f"component {name!r} ({library}:{class_name}) cannot be built empty: only a "
                              f"diffusers model can; load it whole")
    if dtype != torch.float32 and getattr(cls, "_keep_in_fp32_modules", None):
        raise CheckpointError(f"component {name!r}: {class_name} keeps some modules in float32 under a lower "
                              f"dtype; build it empty in float32 only")
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # what from_pretrained builds before loading
        module = cls.from_config(cls.load_config(str(folder)))
    module.to(dtype=dtype)
    _check_shapes(name, folder, module)
    return module.eval().requires_grad_(False)


def _meta_component(name: str, library: str, class_name: str, folder: Path, dtype: torch.dtype):
    """The component built from its config alone with every tensor on the meta device, in `dtype`
    (the modules a class keeps in float32 stay so, as `from_pretrained` keeps them): what
    `load_model(..., device="meta")` gives for a memory replay (miles.replay), no weights read.
    A part that is no module (a tokenizer) is None: it holds no tensor."""
    cls = _component_class(name, library, class_name)
    if not issubclass(cls, torch.nn.Module):
        return None
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else default)  # built in dtype, as from_pretrained does
    try:
        with torch.device("meta"):
            if is_diffusers_library(library):
                module = cls.from_config(cls.load_config(str(folder)))
            else:
                module = cls(cls.config_class.from_pretrained(str(folder)))
    finally:
        torch.set_default_dtype(default)
    module.to(dtype=dtype)
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    if dtype != torch.float32 and keep:
        for sub_name, sub in module.named_modules():
            if any(k in sub_name.split(".") for k in keep):
                sub.to(dtype=torch.float32)
    return module.eval().requires_grad_(False)


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file under `folder` that stores it."""
    index = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            index.update(dict.fromkeys(f.keys(), file))
    return index


def read_scheduler_config(path: Path) -> dict[str, Any]:
    config_file = path / SCHEDULER / "scheduler_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no scheduler/scheduler_config.json")
    return json.loads(config_file.read_text())


def read_model_index(path: Path) -> dict[str, Any]:
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise CheckpointError(f"{path} is not a diffusers checkpoint: model_index.json is missing")
    return json.loads(index_file.read_text())


class DiffusionModel:
    def __init__(self, spec: FamilySpec, parts: dict[str, Any], path: Path, boundary_ratio: float | None,
                 device: torch.device, dtype: torch.dtype):
        self.spec = spec
        self.family = spec.name
        self.parts = parts
        self.path = path
        self.boundary_ratio = boundary_ratio
        self.device = device
        self.dtype = dtype
        self.transformers: dict[str, torch.nn.Module] = {n: parts[n] for n in spec.transformer_components}
        self.text_encoders = {n: m for n, m in parts.items() if n.startswith("text_encoder") and m is not None}
        self.vae = parts["vae"]
        self.edm = spec.module.facts.edm_sigmas  # the pipeline samples in EDM coordinates (Cosmos2)
        self.scheduler_config = flow_match_config(read_scheduler_config(path), edm=self.edm)
        self._warned_shift: set[float] = set()

    # -- conditioning -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], negative_prompt: str | list[str] | None = "",
                       max_sequence_length: int | None = None) -> Conditioning:
        """Prompt conditioning, with the negative prompt's when the family is guided.

        `max_sequence_length` is the pipeline's argument of that name (None: the pipeline's default).

        Each distinct text is encoded on its own, so a sample's conditioning is the same whatever
        microgroup it is sampled in (a batched text encoder can differ in the last bits); a text
        repeated in `prompts` (a microgroup is one prompt's samples) is encoded once and copied.
        Negative prompts, the same in every call of a run, are kept across calls (on the host) while
        the text encoders' weights stay unchanged.
        """
        length = max_sequence_length or self.spec.module.max_sequence_length
        cache: dict[str, dict[str, torch.Tensor]] = {}
        negative = None
        if self.spec.guided and negative_prompt is not None:
            negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
            kept = self._kept_negatives(length)
            for text in dict.fromkeys(negatives):
                if text not in kept:
                    kept[text] = {k: v.cpu() for k, v in self._encode_text(text, length).items()}
                cache[text] = {k: v.to(self.device) for k, v in kept[text].items()}
            negative = _joined(cache, negatives)
        for text in dict.fromkeys(prompts):
            if text not in cache:
                cache[text] = self._encode_text(text, length)
        return Conditioning(_joined(cache, list(prompts)), negative)

    def _encode_text(self, text: str, length: int) -> dict[str, torch.Tensor]:
        out = self.spec.module.encode(self.parts, [text], length)
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in out.items()}

    def _kept_negatives(self, length: int) -> dict[str, dict[str, torch.Tensor]]:
        """The negative prompts' encodings at this length, emptied whenever a text encoder's weights
        changed (a load or a bucketed sync copies in place, which bumps each tensor's version; a
        LoRA injection adds tensors)."""
        # each tensor's identity and version: a replaced tensor or an in-place write both show
        weights = tuple((id(p), p._version) for m in self.text_encoders.values() for p in m.parameters())
        if getattr(self, "_negatives_weights", None) != weights:
            self._negatives_weights, self._negatives = weights, {}
        return self._negatives.setdefault(length, {})

    # -- schedule -----------------------------------------------------------------------------

    def sigmas(self, num_steps: int, shift: float | None = None, height: int | None = None,
               width: int | None = None, frames: int = 1) -> list[float]:
        """The sigmas the family's pipeline runs for this checkpoint's scheduler config.

        `shift` (--diffusion-shift) replaces the config's shift and turns dynamic shifting off;
        the resolution is needed when the config shifts dynamically (mu from the sequence length).
        """
        if self.edm:
            if shift is not None:
                raise ValueError(f"{self.family} samples Karras (EDM) sigmas, which no shift changes: drop --diffusion-shift")
            return edm_flow_sigmas(self.scheduler_config, num_steps)
        config = self._config_with_shift(shift)
        mu = None
        if config["use_dynamic_shifting"]:
            if height is None or width is None:
                raise ValueError(f"{self.path}'s scheduler shifts with the resolution: pass height and width")
            seq_len = self.spec.module.shift_seq_len(self.parts, self.latent_shape(height, width, frames))
            mu = calculate_shift(seq_len, config)
        return flow_match_sigmas(config, num_steps, linspace_sigmas=self.spec.module.linspace_sigmas, mu=mu)

    def _config_with_shift(self, shift: float | None) -> dict[str, Any]:
        config = self.scheduler_config
        if shift is None:
            return config
        overridden = {**config, "shift": float(shift), "use_dynamic_shifting": False}
        if overridden != config and shift not in self._warned_shift:
            self._warned_shift.add(shift)
            logger.warning("--diffusion-shift %s overrides the scheduler of %s (shift %s, dynamic shifting %s); "
                           "sampling will differ from its pipeline", shift, self.path, config["shift"],
                           config["use_dynamic_shifting"])
        return overridden

    def expert_for(self, sigma: float) -> str:
        """The transformer component that denoises at this sigma (Wan2.2: high- vs low-noise)."""
        if isinstance(sigma, int) and not isinstance(sigma, bool):
            raise TypeError(f"expert_for takes a sigma in [0, 1], got the int {sigma}; for a step use expert_for_step")
        index = expert_index_for_step([float(sigma)], 0, self.boundary_ratio)
        return self.spec.transformer_components[index]

    def expert_for_step(self, sigmas: list[float], step: int) -> str:
        return self.spec.transformer_components[expert_index_for_step(sigmas, step, self.boundary_ratio)]

    # -- the forward --------------------------------------------------------------------------

    def velocity(self, x: torch.Tensor, sigma, cond: Conditioning, guidance_scale: float = 1.0,
                 expert: str | None = None, detach_uncond: bool = False) -> torch.Tensor:
        """Guided velocity for latents x [B, ...] at sigma (float or [B]); fp32 [B, ...].

        `expert` picks the transformer component; None picks it per sample from sigma (one call per
        expert present). `detach_uncond` takes no gradient through the unconditional branch
        (flow_grpo's SD3 trainer detaches it); its values, and the call's shapes, stay the same.
        """
        batch = x.shape[0]
        sigmas = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).cpu()
        if sigmas.numel() == 1:
            sigmas = sigmas.expand(batch)
        if cond.batch_size != batch:
            raise ValueError(f"conditioning has batch {cond.batch_size}, latents {batch}")
        guided = cond.negative is not None and guidance_scale > 1.0  # the pipelines guide only when g > 1
        scale = guidance_scale if guided else None
        names = [expert] * batch if expert else [self.expert_for(float(s)) for s in sigmas]
        if len(set(names)) == 1:
            return self._expert_velocity(names[0], x, sigmas, cond, scale, detach_uncond)
        # several experts (SFT draws sigmas across the boundary): one call each, rows put back in order
        rows = {name: [i for i, n in enumerate(names) if n == name] for name in dict.fromkeys(names)}
        parts = [self._expert_velocity(name, x[idx], sigmas[idx], select_rows(cond, idx), scale, detach_uncond)
                 for name, idx in rows.items()]
        order = torch.tensor([i for idx in rows.values() for i in idx]).argsort()
        return torch.cat(parts)[order.to(parts[0].device)]

    def _expert_velocity(self, name: str, x: torch.Tensor, sigmas: torch.Tensor, cond: Conditioning,
                         scale: float | None, detach_uncond: bool) -> torch.Tensor:
        """One expert's (guided) velocity of the whole batch; guidance as the family's pipeline runs it."""
        module, transformer = self.spec.module, self.transformers[name]
        x = x.to(device=self.device, dtype=self.dtype)
        s = sigmas.to(self.device)
        cond = cond.to(self.device)

        def forward(latents, sig, tensors):
            return module.forward(self.parts, transformer, latents, sig, tensors).float()

        if scale is None:
            return forward(x, s, cond.positive)
        if module.cfg_in_one_call:  # [negative; prompt] in one call, as the pipeline concatenates them
            joined = {k: torch.cat([cond.negative[k], cond.positive[k]]) for k in cond.positive}
            uncond, out = forward(torch.cat([x, x]), torch.cat([s, s]), joined).chunk(2)
            uncond = uncond.detach() if detach_uncond else uncond
        else:  # the pipeline's two calls: the prompt's, then the negative prompt's
            out = forward(x, s, cond.positive)
            with torch.no_grad() if detach_uncond else contextlib.nullcontext():
                uncond = forward(x, s, cond.negative)
        return module.guide(out, uncond, scale)

    def initial_latents(self, noise: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
        """The first state from standard normal noise: the noise itself at sigma 1; an EDM pipeline
        starts from sigma_max * noise, which in flow coordinates is sigmas[0] * noise."""
        return noise * sigmas[0] if self.edm else noise

    def pipeline_latents(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        """Latents as the pipeline decodes them: an EDM pipeline's x_edm = x_flow / (1 - t)."""
        return x / (1.0 - sigma) if self.edm else x

    # -- pixels -------------------------------------------------------------------------------

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        return self.spec.module.latent_shape(self.parts, height, width, frames)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, ...] latents -> [B, 3, H, W] (video: [B, F, 3, H, W]) float in [0, 1], on the CPU; the
        batch in one VAE call, as the pipeline decodes."""
        return self.spec.module.decode(self.parts, latents.to(self.device)).float().cpu()

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """The inverse of `decode`: [B, 3, H, W] (video: [B, F, 3, H, W]) in [0, 1] -> [B, ...] fp32
        latents in the transformer's layout, on the model's device.

        The VAE posterior's mean, one sample at a time, so a sample's latents do not depend on the
        batch it is encoded in and the same pixels always give the same latents (SFT data; no
        trainer recomputes these, unlike the engine's batched forwards).
        """
        expected = 5 if self.spec.is_video else 4
        if pixels.ndim != expected:
            layout = "[B, F, 3, H, W]" if self.spec.is_video else "[B, 3, H, W]"
            raise ValueError(f"{self.family} encodes {layout} pixels, got shape {list(pixels.shape)}")
        return torch.cat([
            self.spec.module.encode_images(self.parts, pixels[i : i + 1].to(self.device)).float()
            for i in range(pixels.shape[0])
        ])

    # -- weights ------------------------------------------------------------------------------

    def apply_lora(self, rank: int, alpha: float | None = None, target_modules: list[str] | None = None,
                   components: list[str] | None = None) -> None:
        """Inject PEFT LoRA adapters (B = 0, so outputs are unchanged until weights arrive)."""
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank,
                            target_modules=list(target_modules or self.spec.lora_target_modules))
        for name in components or self.spec.transformer_components:
            module = self.transformers[name]
            if hasattr(module, "add_adapter"):  # diffusers' way: `disable_adapters` (the lora_base KL) then works
                module.add_adapter(config)
            else:
                inject_adapter_in_model(config, module)
            # the adapters in the compute dtype, a module the class keeps in float32 left so (from_pretrained's rule)
            module.to(device=self.device).requires_grad_(False)
            cast_to_rule(module, self.dtype)

    def load_weights(self, component: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy tensors into a component; a partial dict (e.g. only LoRA tensors) is fine.

        Keys may carry PEFT's `base_model.model.` wrapper prefix. Unknown keys and shape
        mismatches are errors, so a broken weight sync cannot pass silently.
        """
        module = self.parts.get(component)
        if module is None:
            raise KeyError(f"no component {component!r}; have {sorted(k for k, v in self.parts.items() if v is not None)}")
        own = module.state_dict()
        prefix = "base_model.model."
        for key, value in state_dict.items():
            target = key[len(prefix):] if key.startswith(prefix) else key
            if target not in own:
                raise KeyError(f"component {component!r} has no tensor {key!r}")
            if tuple(own[target].shape) != tuple(value.shape):
                raise ValueError(f"component {component!r}: tensor {key!r} has shape {list(value.shape)}, "
                                 f"expected {list(own[target].shape)}")
            with torch.no_grad():
                own[target].copy_(value.to(own[target].dtype))


def _joined(encoded: dict[str, dict[str, torch.Tensor]], texts: list[str]) -> dict[str, torch.Tensor]:
    """The batch of `texts`' encodings, in order (a text repeated is its encoding repeated)."""
    return {k: torch.cat([encoded[t][k] for t in texts]) for k in encoded[texts[0]]}


def select_rows(cond: Conditioning, rows: list[int]) -> Conditioning:
    """The batch of `cond`'s rows `rows`, in that order (a row may repeat)."""
    pick = lambda d: None if d is None else {k: t[rows] for k, t in d.items()}  # noqa: E731
    return Conditioning(pick(cond.positive), pick(cond.negative))


# conditioning parts: only prompt encoding reads them (an engine; a trainer only under SFT); LTX-2's
# text connectors turn the text encoder's states into the transformer's conditioning
TEXT_PARTS = ("text_encoder", "tokenizer", "connectors")


def part_dtype(family: str, part: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a part is held and run in: `dtype`, or float32 for a part the family runs in float32
    (`FamilyFacts.float32_parts`: Wan's VAE)."""
    return torch.float32 if get_family_facts(family).runs_in_float32(part) else dtype


@collector_paused()  # the model libraries' lazy imports happen in here (miles.utils.import_cost)
def load_model(path: str | Path, family: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, *, skip: tuple[str, ...] = (),
               empty: dict[str, torch.dtype] | None = None) -> DiffusionModel:
    """The checkpoint's pipeline on `device` in `dtype`.

    `skip`: name prefixes of parts never read (left None, no bytes anywhere), e.g. TEXT_PARTS.
    `empty`: components built with their parameters on the meta device in the given dtype, for
    a sharded trainer to fill rank by rank (miles.backends.sharded_load); they stay on the host.
    `device="meta"`: every part built from its config on meta, no weights read (miles.replay).
    """
    empty = empty or {}
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = read_model_index(path)
    detected = detect_family(path)
    if family is not None and get_family_facts(family).name != detected:
        raise CheckpointError(
            f"checkpoint {path} is a {detected!r} checkpoint ({index.get('_class_name')}), "
            f"but family {family!r} was requested"
        )
    spec = get_family(family or detected)
    listed = {k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list)}
    for name in spec.components:
        if name not in listed or listed[name][0] is None:
            raise CheckpointError(f"checkpoint {path} has no {name!r} component (model_index.json)")
    parts: dict[str, Any] = {}
    device = torch.device(device)
    for name, (library, class_name) in sorted(listed.items()):
        if library is None or name == SCHEDULER:
            # the schedule is computed from the scheduler's config (read_scheduler_config); diffusers'
            # scheduler object would go unused, and building it imports scipy.stats (1.2 s a process)
            parts[name] = None
            continue
        if name.startswith(skip) and name not in spec.transformer_components:
            parts[name] = None
            continue
        folder = path / name
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {path} is missing component {name!r}: no folder {folder}")
        held = part_dtype(spec.name, name, dtype)
        if name in empty:
            parts[name] = _empty_component(name, library, class_name, folder, empty[name])
        elif torch.device(device).type == "meta":  # a memory replay: shapes and dtypes, no weights
            parts[name] = _meta_component(name, library, class_name, folder, held)
        else:
            parts[name] = _load_component(name, library, class_name, folder, held)
        if isinstance(parts[name], torch.nn.Module) and name not in empty:
            # each part to the device as soon as it is loaded: the host then holds one part at a time
            # (every engine of a node loads at once; the whole pipeline each would be Wan2.2's 64 GiB)
            parts[name].to(device=device)
    boundary = index.get("boundary_ratio", spec.boundary_ratio) if spec.boundary_ratio is not None else None
    return DiffusionModel(spec, parts, path, boundary, device, dtype)
