"""The in-place DCP reader against torch's, asynchronous saves in one process, the free-space check, and the
corrupt-file checks of check_resumable."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import CheckpointException, FileSystemReader

from lerobot_mg.checkpoint.dcp_io import InPlaceFileSystemReader
from lerobot_mg.checkpoint.disk import DiskGuard
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.checkpoint.resume import check_resumable
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError
from tests.unit.test_checkpoint_layout import Run, train_one_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(64, 32),
        "transposed": torch.randn(32, 48).t(),  # saved with its strides, not contiguous
        "half": torch.randn(17).to(torch.bfloat16),
        "step": torch.tensor(12.0),
        "counts": torch.arange(10, dtype=torch.int64),
        "groups": [{"lr": 1e-3, "params": ["weight"]}],  # a byte item
    }


def _zeros_like(state: dict) -> dict:
    """The same structure with other values (DCP loads into the structure it is given)."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else [{"lr": 0.0, "params": ["?"]}]
            for k, v in state.items()}


def test_in_place_reader_reads_what_torchs_reader_reads(tmp_path: Path) -> None:
    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    by_torch, ours = _zeros_like(saved), _zeros_like(saved)
    ours["counts"] = torch.zeros(10, dtype=torch.float64)  # another dtype: the read-then-copy path
    dcp.load(by_torch, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    target_weight = ours["weight"]
    dcp.load(ours, storage_reader=InPlaceFileSystemReader(tmp_path), no_dist=True)

    assert ours["weight"] is target_weight  # read into the target itself
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(by_torch[key], value), key
            assert torch.equal(ours[key], value.to(ours[key].dtype)), key
    assert ours["groups"] == by_torch["groups"] == saved["groups"]


def test_in_place_reader_names_a_truncated_shard(tmp_path: Path) -> None:
    dcp.save(_state(), checkpoint_id=tmp_path, no_dist=True)
    shard = tmp_path / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 200)
    with pytest.raises(CheckpointException, match=r"__0_0.distcp: cannot read 'counts' at byte"):
        dcp.load(_zeros_like(_state()), storage_reader=InPlaceFileSystemReader(tmp_path), no_dist=True)


class AsyncRun(Run):
    def __init__(self, output_dir: Path) -> None:
        super().__init__(output_dir)
        self.manager = CheckpointManager(output_dir, "safetensors", None, ParallelDims.resolve(1, 1, 1),
                                         async_save=True)


def test_async_save_writes_the_state_of_its_step_and_moves_last_once_written(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    run = AsyncRun(tmp_path)
    root = tmp_path / "checkpoints"
    run.save(1)
    run.manager.wait()
    assert os.readlink(root / "last") == "000001"

    # Hold the background writer so that the next save is deterministically still in flight.
    release = threading.Event()
    assert run.manager._writer is not None
    run.manager._writer.submit(release.wait)
    step_dir = run.save(2)  # trains one step, then saves
    at_save = {k: v.clone() for k, v in run.policy.state_dict().items()}
    train_one_step(run.policy, run.optimizer)  # training goes on while the save is in flight
    run.manager.poll()
    assert os.readlink(root / "last") == "000001"  # nothing written yet: `last` stays
    assert (root / ".tmp-000002").is_dir() and not step_dir.exists()

    release.set()
    with caplog.at_level(logging.INFO, logger="lerobot_mg.checkpoint.manager"):
        run.manager.wait()
    assert os.readlink(root / "last") == "000002"
    check_resumable(step_dir)
    written = load_file(str(step_dir / "pretrained_model" / "model.safetensors"))
    changed = [k for k in at_save if not torch.equal(at_save[k], run.policy.state_dict()[k])]
    assert changed, "the step after the save changed no weight: the test would prove nothing"
    for key, value in at_save.items():
        assert torch.equal(written[key], value), key  # the staged copy, not the weights trained since
    on_disk = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    assert f"Checkpoint {step_dir}: {on_disk / 2**20:.2f} MiB written in " in caplog.text
    assert " MiB staged in host memory)." in caplog.text  # the staged copy above is what was written
    run.manager.close()


def test_a_save_that_cannot_fit_stops_before_writing(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.save(1)
    tmp = tmp_path / "checkpoints" / ".tmp-000002"
    tmp.mkdir()
    needed = shutil.disk_usage(tmp).free + 2**30
    with pytest.raises(ConfigError, match=rf"could not write checkpoint {tmp}: .* bytes free on its file system; it "
                                          rf"needs about {needed:,} bytes on this rank; the previous checkpoint "
                                          rf".*000001 is intact. Fix: free space"):
        DiskGuard(tmp_path / "checkpoints", ParallelDims.resolve(1, 1, 1)).check_free_space(tmp, needed)
    assert not tmp.exists()
    check_resumable(tmp_path / "checkpoints" / "last")


def test_the_next_start_removes_partial_saves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    Run(tmp_path).save(1)
    partial = tmp_path / "checkpoints" / ".tmp-000002"
    (partial / "pretrained_model").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="lerobot_mg.checkpoint.manager"):
        Run(tmp_path)
    assert not partial.exists()
    assert f"Removing {partial}: a checkpoint save that never completed" in caplog.text


@pytest.fixture
def step_dir(tmp_path: Path) -> Path:
    return Run(tmp_path).save(4)


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("name", ["pretrained_model/model.safetensors", "training_state/optimizer_state.safetensors",
                                  "training_state/rng_state.safetensors"])
def test_refuses_a_truncated_safetensors_file(step_dir: Path, name: str) -> None:
    path = step_dir / name
    _truncate(path, path.stat().st_size - 1)
    with pytest.raises(ConfigError, match=rf"{path} is truncated: .* bytes. Fix: resume from an earlier complete"):
        check_resumable(step_dir)
    _truncate(path, 4)
    with pytest.raises(ConfigError, match=rf"{path} is not a safetensors file \(4 bytes\)"):
        check_resumable(step_dir)


def test_refuses_a_truncated_dcp_shard(step_dir: Path) -> None:
    shards = step_dir / "pretrained_model" / "pytorch_model_fsdp_0"
    dcp.save({"w": torch.zeros(300)}, checkpoint_id=shards, no_dist=True)
    check_resumable(step_dir)
    _truncate(shards / "__0_0.distcp", 100)
    with pytest.raises(ConfigError, match=r"pytorch_model_fsdp_0 has unusable shard file\(s\) \['__0_0.distcp "
                                          r"\(truncated: 100 of .* bytes\)'\]. Fix: delete .* to resume from"):
        check_resumable(step_dir)


@pytest.mark.parametrize("drop", ["step", "progress", "sampler", "progress.samples_seen"])
def test_refuses_a_training_step_json_with_missing_keys(step_dir: Path, drop: str) -> None:
    marker = step_dir / "training_state" / "training_step.json"
    info = json.loads(marker.read_text())
    section, _, key = drop.partition(".")
    del (info[section] if key else info)[key or section]
    marker.write_text(json.dumps(info))
    with pytest.raises(ConfigError, match=rf"{marker} lacks the key\(s\) \['{drop}'\] a resume reads. Fix: "):
        check_resumable(step_dir)
