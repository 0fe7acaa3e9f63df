"""Merge a checkpoint's DCP weight shards into one ``model.safetensors``: offline, one process, no GPU.

```bash
lerobot-mg-convert-dcp checkpoint_dir=outputs/train/run/checkpoints/005000
lerobot-mg-convert-dcp --checkpoint_dir=outputs/train/run/checkpoints/last --delete_dcp=true
lerobot-mg-convert-dcp checkpoint_dir=... delete_dcp=true push_to_hub=${HF_USER}/my_policy
python scripts/convert_dcp.py checkpoint_dir=outputs/train/run/checkpoints/005000
```

``checkpoint_dir`` is a step directory (``checkpoints/005000`` or ``checkpoints/last``) or its
``pretrained_model/`` directory. The shards in ``pretrained_model/pytorch_model_fsdp_0/`` are keyed by the
policy's parameter FQNs, so the merged file is exactly what ``save_pretrained`` writes for a gathered
checkpoint of the same step (``adapter_model.safetensors`` when the directory holds a PEFT adapter). A checkpoint
of a run with ``ema.enable=true`` has its EMA weights' shards in ``pretrained_model_ema/pytorch_model_fsdp_0/``:
they are merged the same way, into ``pretrained_model_ema/model.safetensors``.
``delete_dcp=true`` removes the shards only after the merged file has been re-read and compared tensor by
tensor. ``push_to_hub=<user>/<repo>`` uploads the safetensors, json and md files of ``pretrained_model/`` (the model
card a training run wrote included); on a checkpoint without shards it only uploads, which is how the checkpoint of
a run whose own upload failed is published later. The repo is private, and the card carries the license and tags,
as the checkpoint's config.json records them (``policy.private``, ``policy.license``, ``policy.tags`` of its run);
``private=``, ``license=`` and ``tags=`` set them here instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lerobot_mg import cli
from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.dcp_io import load_dcp
from lerobot_mg.checkpoint.hub import RepoSettings, check_can_push, push_pretrained
from lerobot_mg.checkpoint.unpickle import read_dcp_metadata
from lerobot_mg.errors import ConfigError

logger = logging.getLogger(__name__)

# Tensors are read from the shards in groups of about this many bytes, one progress-bar tick per group.
_READ_GROUP_BYTES = 256 * 2**20
# Below this size a merge takes a moment and a progress bar is noise.
_PROGRESS_MIN_BYTES = 512 * 2**20


# --- reading DCP offline ----------------------------------------------------------------------------------


def _check_saved_completely(dcp_dir: Path) -> None:
    """A shard directory without ``.metadata`` (written last) is a save that never finished: the user's choice of
    directory, not a fault. Its metadata is read by :func:`lerobot_mg.checkpoint.unpickle.read_dcp_metadata`."""
    if not (Path(dcp_dir) / ".metadata").is_file():
        raise ConfigError(f"{dcp_dir}: is not a DCP checkpoint directory (it has no .metadata file, which a save "
                          "writes last). Fix: checkpoint_dir=<a step directory saved completely, e.g. an earlier "
                          "step>")


def dcp_tensor_specs(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The tensor entries of a DCP checkpoint, by flattened key (non-tensor entries such as an optimizer's
    param_groups are left out)."""
    return {
        key: value for key, value in metadata.state_dict_metadata.items() if isinstance(value, TensorStorageMetadata)
    }


def _tensor_nbytes(spec: TensorStorageMetadata) -> int:
    return spec.size.numel() * torch.empty((), dtype=spec.properties.dtype).element_size()


def _key_groups(specs: dict[str, TensorStorageMetadata]) -> Iterator[list[str]]:
    group: list[str] = []
    group_bytes = 0
    for key, spec in specs.items():
        group.append(key)
        group_bytes += _tensor_nbytes(spec)
        if group_bytes >= _READ_GROUP_BYTES:
            yield group
            group, group_bytes = [], 0
    if group:
        yield group


def read_dcp_tensors(dcp_dir: Path, show_progress: bool | None = None) -> dict[str, Tensor]:
    """Every tensor of a DCP checkpoint as one full CPU tensor per key, whatever the shard layout.

    Runs in a plain process: no process group, no GPU. ``show_progress=None`` shows a progress bar for
    checkpoints of at least 512 MiB.
    """
    dcp_dir = Path(dcp_dir)
    _check_saved_completely(dcp_dir)
    metadata = read_dcp_metadata(dcp_dir)
    specs = dcp_tensor_specs(metadata)
    total_bytes = sum(_tensor_nbytes(spec) for spec in specs.values())
    if show_progress is None:
        show_progress = total_bytes >= _PROGRESS_MIN_BYTES
    from tqdm.auto import tqdm

    tensors: dict[str, Tensor] = {}
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"merge {dcp_dir.name}",
              disable=not show_progress) as bar:
        for keys in _key_groups(specs):
            group = {key: torch.empty(specs[key].size, dtype=specs[key].properties.dtype) for key in keys}
            with warnings.catch_warnings():  # no process group is the point here, not a mistake
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                # A partial state dict reads only these keys' chunks from the shard files.
                load_dcp(group, dcp_dir, metadata, no_dist=True)
            tensors.update(group)
            bar.update(sum(_tensor_nbytes(specs[key]) for key in keys))
    return tensors


# --- converting -------------------------------------------------------------------------------------------


def resolve_pretrained_dir(checkpoint_dir: Path) -> Path:
    """``checkpoints/<step or last>`` or its ``pretrained_model/`` -> the ``pretrained_model/`` directory."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ConfigError(
            f"checkpoint_dir={str(checkpoint_dir)!r} is not a directory. Fix: "
            "checkpoint_dir=<run>/checkpoints/<step or last>"
        )
    if (checkpoint_dir / L.PRETRAINED_MODEL_DIR).is_dir():
        return (checkpoint_dir / L.PRETRAINED_MODEL_DIR).resolve()
    if checkpoint_dir.name == L.PRETRAINED_MODEL_DIR or (checkpoint_dir / L.MODEL_DCP_DIR).is_dir():
        return checkpoint_dir.resolve()
    raise ConfigError(
        f"checkpoint_dir={str(checkpoint_dir)!r} holds no {L.PRETRAINED_MODEL_DIR}/ directory. Fix: "
        "checkpoint_dir=<run>/checkpoints/<step or last>"
    )


def merged_file_name(pretrained_dir: Path) -> str:
    """A PEFT checkpoint's shards hold the adapter only, and merge into the adapter file."""
    return L.ADAPTER_SAFETENSORS if (Path(pretrained_dir) / L.ADAPTER_CONFIG_JSON).is_file() else L.MODEL_SAFETENSORS


def _verify_written(path: Path, expected: dict[str, Tensor]) -> None:
    written = load_file(str(path))
    if written.keys() != expected.keys():
        raise RuntimeError(f"{path} was written with keys {sorted(written)} instead of {sorted(expected)}.")
    for key, tensor in expected.items():
        if written[key].dtype != tensor.dtype or not torch.equal(written[key], tensor):
            raise RuntimeError(f"{path} does not read back equal to the DCP shards at key {key!r}.")


def convert_checkpoint(checkpoint_dir: Path, delete_dcp: bool = False, show_progress: bool | None = None) -> Path:
    """Merge ``pretrained_model/pytorch_model_fsdp_0/`` into ``pretrained_model/model.safetensors``, and the EMA
    weights' shards beside it (``pretrained_model_ema/``) into theirs.

    The file is written beside its final name, re-read and compared with the shards, then renamed into
    place (replacing a gathered file of a ``safetensors_dcp`` checkpoint, which holds the same tensors).
    ``delete_dcp`` removes the shard directory only after that. Returns the merged file of ``pretrained_model/``.
    """
    pretrained = resolve_pretrained_dir(checkpoint_dir)
    target = _merge(pretrained, delete_dcp, show_progress)
    ema = pretrained.parent / L.PRETRAINED_MODEL_EMA_DIR
    if pretrained.name == L.PRETRAINED_MODEL_DIR and (ema / L.MODEL_DCP_DIR).is_dir():
        _merge(ema, delete_dcp, show_progress)
    return target


def ema_file(merged: Path) -> Path | None:
    """The EMA weights' file beside a checkpoint's merged ``pretrained_model/`` file, if the checkpoint has one."""
    ema = merged.parent.parent / L.PRETRAINED_MODEL_EMA_DIR / merged.name
    return ema if merged.parent.name == L.PRETRAINED_MODEL_DIR and ema.is_file() else None


def _merge(pretrained: Path, delete_dcp: bool, show_progress: bool | None) -> Path:
    """Merge one weights directory's shards (see :func:`convert_checkpoint`)."""
    dcp_dir = pretrained / L.MODEL_DCP_DIR
    if not dcp_dir.is_dir():
        raise ConfigError(
            f"{pretrained}: holds no {L.MODEL_DCP_DIR}/ to convert (the checkpoint was saved with "
            "checkpoint.format=safetensors, or the shards were already merged and deleted). Fix: none needed, its "
            f"{merged_file_name(pretrained)} is already loadable (policy.path={str(pretrained)!r})"
        )
    _check_saved_completely(dcp_dir)
    metadata = read_dcp_metadata(dcp_dir)
    non_tensor_keys = sorted(set(metadata.state_dict_metadata) - set(dcp_tensor_specs(metadata)))
    if non_tensor_keys:
        raise ConfigError(
            f"{dcp_dir}: holds non-tensor entries {non_tensor_keys[:5]}, so it is not a weight shard directory "
            f"(optimizer shards live in {L.TRAINING_STATE_DIR}/{L.OPTIMIZER_DCP_DIR}/ and are not converted). "
            "Fix: checkpoint_dir=<run>/checkpoints/<step or last>"
        )
    tensors = read_dcp_tensors(dcp_dir, show_progress=show_progress)
    target = pretrained / merged_file_name(pretrained)
    partial = target.with_name(target.name + ".part")
    save_file(tensors, str(partial), metadata={"format": "pt"})
    _verify_written(partial, tensors)
    os.replace(partial, target)
    logger.info("Merged %d tensors from %s into %s", len(tensors), dcp_dir, target)
    if delete_dcp:
        shutil.rmtree(dcp_dir)
        logger.info("Deleted %s", dcp_dir)
    return target


# --- command line -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertArgs:
    checkpoint_dir: Path = field(metadata={"help": "a step directory (checkpoints/005000 or checkpoints/last) or "
                                                   "its pretrained_model/"})
    delete_dcp: bool = field(default=False, metadata={"help": "remove the shards once the merged file is verified"})
    push_to_hub: str | None = field(default=None, metadata={"help": "<user>/<repo> to upload pretrained_model/ to"})
    # The repo's settings, as LeRobot's policy.private / policy.license / policy.tags: by default the checkpoint's own.
    private: bool | None = field(default=None, metadata={
        "help": "with push_to_hub: create the repo private (null: as the checkpoint's config.json says)"})
    license: str | None = field(default=None, metadata={
        "help": "with push_to_hub: the model card's license (null: the checkpoint's, else apache-2.0)"})
    tags: list[str] | None = field(default=None, metadata={
        "help": "with push_to_hub: the model card's tags (null: the checkpoint's), beside robotics, lerobot, <type>"})

    def __post_init__(self) -> None:
        if self.push_to_hub is not None and self.push_to_hub.count("/") != 1:
            raise ConfigError(f"push_to_hub={self.push_to_hub}: expected a repo id <user>/<repo>. "
                              "Fix: push_to_hub=${HF_USER}/my_policy")


def run(args: ConvertArgs) -> None:
    """Convert (and publish). With ``push_to_hub``, a checkpoint that already holds its safetensors weights (no DCP
    shards: ``checkpoint.format=safetensors``, or converted before) is published as it is: the command a training
    run prints when its own upload failed."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.push_to_hub is not None:  # refuse a push that cannot happen before the (possibly long) merge
        check_can_push("push_to_hub", args.push_to_hub)
    pretrained = resolve_pretrained_dir(args.checkpoint_dir)
    if args.push_to_hub is not None and not (pretrained / L.MODEL_DCP_DIR).is_dir():
        target = pretrained / merged_file_name(pretrained)
    else:
        target = convert_checkpoint(args.checkpoint_dir, delete_dcp=args.delete_dcp)
        print(f"wrote {target}", flush=True)
        if (ema := ema_file(target)) is not None:
            print(f"wrote {ema}", flush=True)
    if args.push_to_hub is not None:
        settings = RepoSettings.of_pretrained(target.parent).overridden(args.private, args.license, args.tags)
        url = push_pretrained(target.parent, args.push_to_hub, publish_message(target.parent), key="push_to_hub",
                              settings=settings)
        print(f"pushed {target.parent} to {url}", flush=True)


def publish_message(pretrained_dir: Path) -> str:
    return f"Upload {Path(pretrained_dir).parent.name} (lerobot_mg)"


def main(argv: list[str] | None = None) -> int:
    """``lerobot-mg-convert-dcp``; returns the exit status (2 on a user error)."""
    return cli.run(ConvertArgs, run, "lerobot-mg-convert-dcp", __doc__, argv)
