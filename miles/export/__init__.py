"""Trained weights out of the framework: a checkpoint becomes what diffusers loads.

    python3 -m miles.export <run dir | checkpoint root | rollout_NNNNNN dir> --out DIR

`source.py` finds the checkpoint and the run that wrote it, `tensors.py` reads its trained
tensors (data-parallel safetensors or fsdp DCP shards), `lora.py` writes an adapter in the
diffusers LoRA format, `transformer.py` a transformer folder in diffusers layout, `pipeline.py`
a whole pipeline folder, `card.py` the model card; `cli.py` joins them and writes the result
into a temporary folder that is renamed to --out only once it is whole.
"""
