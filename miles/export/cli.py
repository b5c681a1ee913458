"""`python3 -m miles.export SOURCE --out DIR`: a checkpoint as what diffusers loads.

SOURCE is a run dir, its checkpoints dir or one rollout_NNNNNN dir. A LoRA run gives its adapter
in the diffusers LoRA format (`pipe.load_lora_weights(DIR)`), a full fine-tune its transformer
folder(s) in diffusers layout, or with --pipeline a whole pipeline folder
(`DiffusionPipeline.from_pretrained(DIR)`); a model card README.md comes with either. The result
is written beside --out under a temporary name and renamed to it once whole.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from miles.export.errors import ExportError

_SIZE = re.compile(r"^(\d+)\s*(B|KB|MB|GB)?$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def shard_size(value: str) -> int:
    matched = _SIZE.match(value.strip())
    if matched is None or int(matched.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 500MB or 1000000 (bytes), got {value!r}")
    return int(matched.group(1)) * _UNITS[matched.group(2) and matched.group(2).upper()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m miles.export", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a run dir, its checkpoints dir, or one rollout_NNNNNN checkpoint dir")
    p.add_argument("--out", required=True,
                   help="the folder to write: never inside a run, its checkpoints or the base checkpoint "
                        "(refused if it exists, unless --overwrite and it is an earlier export)")
    p.add_argument("--rollout", default="latest", help="rollout id of the checkpoint to export (default: latest)")
    p.add_argument("--ema", action="store_true", help="export the EMA shadow weights (runs with --use-ema)")
    p.add_argument("--pipeline", action="store_true",
                   help="full fine-tunes: a complete pipeline folder, the base's other components linked or copied")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is an earlier export (it holds the export's marker file)")
    p.add_argument("--family", default=None, help="refuse unless the checkpoint is of this family")
    p.add_argument("--max-shard-size", type=shard_size, default=shard_size("5GB"),
                   help="largest safetensors shard of an exported transformer (5GB, 500MB, bytes)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.rollout != "latest" and not args.rollout.isdigit():
        raise ExportError(f"--rollout {args.rollout}: expected a rollout id (0, 1, ...) or latest")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        out = export(args)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    print(out)
    return 0


def export(args: argparse.Namespace) -> Path:
    from miles.export.destination import check_destination
    from miles.export.source import locate

    from safetensors import SafetensorError

    out = Path(args.out)
    source = locate(args.source, args.rollout, args.family)
    check_destination(out, source, Path(args.source), args.overwrite)
    if args.pipeline and source.lora is not None:
        raise ExportError("--pipeline: this is a LoRA checkpoint; it exports as an adapter for "
                          "pipe.load_lora_weights on the base pipeline: drop --pipeline")
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        write_export(partial, source, args)
        _replace(partial, out)
    except ExportError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:  # a corrupt file, a full disk
        shutil.rmtree(partial, ignore_errors=True)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = unreadable_file(source.checkpoint) or source.checkpoint
        raise ExportError(f"exporting {source.checkpoint} failed: {where} ({type(err).__name__}: {reason}); "
                          f"--out {out} was not written; fix: export another rollout (--rollout N) or restore "
                          f"that file") from err
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def unreadable_file(checkpoint: Path) -> Path | None:
    """The first safetensors file of the checkpoint whose header does not read (truncated, corrupt)."""
    from safetensors import safe_open

    for path in sorted(checkpoint.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception:  # any failure to read it is what we are looking for
            return path
    return None


def write_export(folder: Path, source, args: argparse.Namespace) -> None:
    from miles.export.card import model_card
    from miles.export.destination import write_marker
    from miles.export.load_snippet import how_to_load
    from miles.export.lora import write_lora
    from miles.export.pipeline import add_base_components
    from miles.export.tensors import EMA, MODEL, open_tensors
    from miles.export.transformer import write_transformer

    reader = open_tensors(source.checkpoint, source.backend)
    kind = EMA if args.ema else MODEL
    components = reader.components(kind)
    if not components:
        raise ExportError(f"{source.checkpoint} holds no EMA weights (the run had no --use-ema): drop --ema"
                          if args.ema else f"{source.checkpoint} holds no trained weights")
    if source.lora is not None:
        files = [write_lora(folder, source.lora, c, reader, kind).name for c in components]
    else:
        files = [write_transformer(folder, source.base / c, c, reader, kind, args.max_shard_size).name + "/"
                 for c in components]
        if args.pipeline:
            add_base_components(folder, source.base, components, source.family)
    (folder / "README.md").write_text(model_card(source, kind, files,
                                                 how_to_load(source, components, args.out, args.pipeline)))
    write_marker(folder, source)
    _ordinary_permissions(folder)


def _ordinary_permissions(folder: Path) -> None:
    """Files as an ordinary `open` would have made them (the umask's 0644): safetensors writes its
    file through a private temporary one (0600), which would hide a shard from the rest of a team.
    A file hard-linked from the base (--pipeline) is the base's own: its mode is left alone."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir():
            path.chmod(0o777 & ~umask)
        elif not path.is_symlink() and path.stat().st_nlink == 1:
            path.chmod(0o666 & ~umask)


def _replace(partial: Path, out: Path) -> None:
    """Rename the finished folder into place; an old --out (under --overwrite) goes only after."""
    if not out.exists():
        os.rename(partial, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(partial, out)
    shutil.rmtree(old) if old.is_dir() else old.unlink()
