"""Whether a checkpoint's weight, optimizer and RNG files are whole, checked before a resume starts any process.

Reads headers, DCP metadata (through the allow-list of :mod:`lerobot_mg.checkpoint.unpickle`), each DCP item's
pickle and file sizes, never the tensor data: a missing, truncated or unreadable file is refused with a
ConfigError that names it and the remedy, before the run builds a model or joins a process group.
training_step.json, the completion marker, is checked by :mod:`lerobot_mg.checkpoint.resume`, which calls this.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.dcp_io import item_problems, shard_files
from lerobot_mg.checkpoint.unpickle import read_dcp_metadata
from lerobot_mg.errors import ConfigError
from lerobot_mg.safe_paths import RefusedFile


def earlier_checkpoint_fix(step_dir: Path) -> str:
    """The remedy for a damaged file of ``step_dir``."""
    return ("resume from an earlier complete checkpoint (config_path="
            f"{step_dir.parent}/<step>/{L.PRETRAINED_MODEL_DIR}/{L.TRAIN_CONFIG_JSON}) or restore the file from a copy")


def dcp_problems(dcp_dir: Path) -> list[str]:
    """Shard files the DCP metadata references that are missing or shorter than the data it places in them, and
    items whose pickle does not read. Raises :class:`~lerobot_mg.safe_paths.RefusedFile` (a ``ConfigError``) when
    .metadata or an item's pickle names anything a checkpoint never holds, an item's archive entry is compressed or
    larger than the item, or a shard's path leads out of ``dcp_dir``: nothing of it is run or inflated."""
    try:
        metadata = read_dcp_metadata(dcp_dir)
    except FileNotFoundError:
        return [".metadata (missing)"]
    except RefusedFile:
        raise
    except Exception as error:  # a truncated pickle: EOFError, UnpicklingError, ...
        return [f".metadata (unreadable: {type(error).__name__})"]
    files = shard_files(dcp_dir, metadata.storage_data or {})
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        path = files[name]
        if not path.is_file():
            problems.append(f"{name} (missing)")
        elif path.stat().st_size < end:
            problems.append(f"{name} (truncated: {path.stat().st_size:,} of {end:,} bytes)")
    return problems or item_problems(dcp_dir, metadata, files)


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (a header that does not parse, or data shorter than the header
    says), or None. Reads the header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                return f"truncated: {size:,} bytes, shorter than its own header"
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        return f"not a safetensors file ({size:,} bytes)"
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        return f"truncated: {size:,} of {8 + header_len + end:,} bytes"
    return None


def check_checkpoint_files(step_dir: Path, saved_sharded: bool) -> None:
    """Raise ``ConfigError`` (naming the file and the remedy) if a weight, optimizer or RNG file of ``step_dir`` is
    missing, truncated or unusable. ``saved_sharded``: the run that wrote it was sharded (its training_step.json
    says so)."""
    pretrained, training_state = step_dir / L.PRETRAINED_MODEL_DIR, step_dir / L.TRAINING_STATE_DIR
    earlier = earlier_checkpoint_fix(step_dir)

    def check_file(path: Path) -> None:
        problem = safetensors_problem(path)
        if problem is not None:
            raise ConfigError(f"{path} is {problem}. Fix: {earlier}")

    model_dcp = pretrained / L.MODEL_DCP_DIR
    if model_dcp.is_dir():
        problems = dcp_problems(model_dcp)
        if problems:
            remedy = (
                f"delete {model_dcp} to resume from {pretrained / L.MODEL_SAFETENSORS}"
                if (pretrained / L.MODEL_SAFETENSORS).is_file() and safetensors_problem(pretrained / L.MODEL_SAFETENSORS) is None
                else earlier
            )
            raise ConfigError(f"{model_dcp} has unusable shard file(s) {problems}. Fix: {remedy}")
    else:
        weights = [pretrained / name for name in (L.MODEL_SAFETENSORS, L.ADAPTER_SAFETENSORS)
                   if (pretrained / name).is_file()]
        if not weights:
            raise ConfigError(
                f"{pretrained} holds none of {L.MODEL_SAFETENSORS}, {L.ADAPTER_SAFETENSORS}, {L.MODEL_DCP_DIR}/: no "
                f"weights to resume from. Fix: {earlier}"
            )
        for path in weights:
            check_file(path)

    optim_dcp = training_state / L.OPTIMIZER_DCP_DIR
    if optim_dcp.is_dir():
        problems = dcp_problems(optim_dcp)
        if problems:
            raise ConfigError(f"{optim_dcp} has unusable shard file(s) {problems}. Fix: {earlier}")
    elif (training_state / L.OPTIMIZER_STATE).is_file():
        if saved_sharded:
            raise ConfigError(
                f"{training_state / L.OPTIMIZER_STATE} is a gathered full optimizer state of a sharded run (the "
                "LeRobot <= 0.6.x FSDP layout), which cannot be resumed: sharded runs keep their optimizer as "
                f"DCP shards in {L.OPTIMIZER_DCP_DIR}/. Fix: start a new run from the weights (run "
                "lerobot-mg-convert-dcp if they are DCP shards) instead of resuming"
            )
        check_file(training_state / L.OPTIMIZER_STATE)
        if not (training_state / L.OPTIMIZER_PARAM_GROUPS).is_file():
            raise ConfigError(f"{training_state / L.OPTIMIZER_PARAM_GROUPS} is missing; the optimizer cannot be "
                              f"restored. Fix: {earlier}")
    else:
        raise ConfigError(f"{training_state} holds no optimizer state ({L.OPTIMIZER_STATE} or "
                          f"{L.OPTIMIZER_DCP_DIR}/). Fix: {earlier}")
    if not (training_state / L.RNG_STATE).is_file():
        raise ConfigError(f"{training_state / L.RNG_STATE} is missing; the RNG state cannot be restored. Fix: {earlier}")
    check_file(training_state / L.RNG_STATE)
