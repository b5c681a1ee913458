"""Prompt data read from JSONL: `--prompt-data`, `--input-key`, `--metadata-key`.

Each line is one JSON object; `record[input_key]` is the prompt and `record[metadata_key]`, when
present, a dict handed to the sampler and the rewards (for example `{"rm_type": "ocr",
"text": "HELLO"}`). The dataset walks epochs in an order fixed by a seed, hands out batches of
`--rollout-batch-size` prompts, and saves its position with the checkpoint so a resumed run
draws exactly the prompts it would have drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.utils.epochs import EpochCursor


class PromptDataError(ValueError):
    """A prompt file that cannot be used; the message names the file and, where known, the line."""


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # position of the prompt in the file, 0-based


def _decode_line(raw: bytes, path: Path, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PromptDataError(f"{path}: line {line_number} is not UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                              f"{err.start + 1} of the line); fix: save the file as UTF-8 (e.g. iconv -f latin1 -t "
                              f"utf-8 {path.name})") from None


def _parse_line(text: str, where: str, index: int, input_key: str, metadata_key: str) -> PromptItem:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptDataError(f"{where}: malformed JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(record, dict):
        raise PromptDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if input_key not in record:
        raise PromptDataError(
            f"{where}: missing input key {input_key!r} (keys: {', '.join(sorted(record)) or 'none'}); "
            f"set --input-key"
        )
    prompt = record[input_key]
    if not isinstance(prompt, str):
        raise PromptDataError(f"{where}: {input_key!r} must be a string, got {type(prompt).__name__}")
    metadata = record.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise PromptDataError(f"{where}: {metadata_key!r} must be an object, got {type(metadata).__name__}")
    return PromptItem(prompt=prompt, metadata=metadata, index=index)


def read_prompt_file(path: str | Path, input_key: str = "prompt", metadata_key: str = "metadata") -> list[PromptItem]:
    """Every prompt of a JSONL file, in file order; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"{path}: prompt file not found (--prompt-data)")
    items: list[PromptItem] = []
    with path.open("rb") as handle:  # decoded line by line, so a bad byte is reported with its line
        for line_number, raw in enumerate(handle, start=1):
            text = _decode_line(raw, path, line_number)
            if text.strip():
                items.append(_parse_line(text, f"{path}:{line_number}", len(items), input_key, metadata_key))
    if not items:
        raise PromptDataError(f"{path}: no prompts in the file")
    return items


def check_disjoint(train: list[PromptItem], train_path: str | Path, held_out: list[PromptItem],
                   eval_path: str | Path) -> None:
    """Eval prompts must be held out: an eval prompt that is also a training prompt measures
    memorisation, not the policy. Raises PromptDataError naming both files and one shared prompt."""
    if Path(train_path).resolve() == Path(eval_path).resolve():
        raise PromptDataError(f"--eval-prompt-data {eval_path} is the training prompt file (--prompt-data); "
                              f"fix: evaluate on a held-out prompt file")
    seen = {item.prompt for item in train}
    shared = [item for item in held_out if item.prompt in seen]
    if shared:
        raise PromptDataError(
            f"{len(shared)} of the {len(held_out)} eval prompts in {eval_path} are also training prompts in "
            f"{train_path} (e.g. {shared[0].prompt!r}); fix: evaluate on prompts held out from training")


class PromptDataset(EpochCursor[PromptItem]):
    """Batches of prompts over epochs, each epoch in an order fixed by `seed` and the epoch number."""

    noun = "prompts"
    error = PromptDataError

    def __init__(
        self,
        items: list[PromptItem],
        *,
        seed: int = 42,
        shuffle: bool = False,
        source: str = "<memory>",
    ) -> None:
        if not items:
            raise PromptDataError(f"{source}: no prompts")
        self.items = list(items)
        self.seed = seed
        self.shuffle = shuffle
        self.source = source
        self._start_epoch(0)

    @classmethod
    def from_jsonl(
        cls, path: str | Path, input_key: str = "prompt", metadata_key: str = "metadata", *,
        seed: int = 42, shuffle: bool = False,
    ) -> "PromptDataset":
        items = read_prompt_file(path, input_key, metadata_key)
        return cls(items, seed=seed, shuffle=shuffle, source=str(path))

    @classmethod
    def from_args(cls, args: Any, path: str | Path | None = None) -> "PromptDataset":
        """The training prompts from the trainer's flags (`path` overrides `--prompt-data`, e.g. for eval).
        Loading the training prompts also checks that no eval prompt (`--eval-prompt-data`) is one of them."""
        training = path is None
        path = path if path is not None else getattr(args, "prompt_data", None)
        if not path:
            raise PromptDataError("no prompt file: pass --prompt-data")
        input_key = getattr(args, "input_key", None) or "prompt"
        metadata_key = getattr(args, "metadata_key", None) or "metadata"
        dataset = cls.from_jsonl(path, input_key, metadata_key, seed=getattr(args, "rollout_seed", 42),
                                 shuffle=bool(getattr(args, "rollout_shuffle", False)))
        eval_path = getattr(args, "eval_prompt_data", None)
        if training and eval_path and getattr(args, "eval_interval", None):
            check_disjoint(dataset.items, path, read_prompt_file(eval_path, input_key, metadata_key), eval_path)
        return dataset

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

