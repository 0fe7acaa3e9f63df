"""Checkpoint layout, pickle-free state files, the single-process manager (keep_last, an interrupted save), and
every message check_resumable gives for a checkpoint that cannot be resumed."""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.manager import CheckpointManager, SaveItems
from lerobot_mg.checkpoint.resume import check_resumable
from lerobot_mg.checkpoint.state import (
    capture_rng_state,
    flatten_optimizer_state,
    pack_rank_states,
    restore_rng_state,
    unflatten_optimizer_state,
    unpack_rank_states,
)
from lerobot_mg.config.act import ACTConfig
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.act.modeling_act import ACTPolicy
from lerobot_mg.run_facts import Progress

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_policy() -> ACTPolicy:
    torch.manual_seed(0)
    config = ACTConfig(chunk_size=4, n_action_steps=4, dim_model=16, n_heads=2, dim_feedforward=32,
                       n_encoder_layers=1, n_decoder_layers=1, latent_dim=4, n_vae_encoder_layers=1)
    return ACTPolicy(config, {"observation.state": {"type": "STATE", "shape": [3]}},
                     {"action": {"type": "ACTION", "shape": [2]}})


def train_one_step(policy: ACTPolicy, optimizer: torch.optim.Optimizer) -> None:
    batch = {"observation.state": torch.randn(2, 3), "action": torch.randn(2, 4, 2),
             "action_is_pad": torch.zeros(2, 4, dtype=torch.bool)}
    loss, _ = policy(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


class Run:
    """A single-process run's model, optimizer and checkpoint manager."""

    def __init__(self, output_dir: Path, keep_last: int | None = None) -> None:
        self.policy = tiny_policy()
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=1e-3)
        self.manager = CheckpointManager(output_dir, "safetensors", keep_last, ParallelDims.resolve(1, 1, 1))

    def save(self, step: int) -> Path:
        train_one_step(self.policy, self.optimizer)
        info = {"step": step, "progress": asdict(Progress(step=step)), "sampler": {"epoch": 0, "position": step},
                "facts": {"topology": {"dp_replicate": 1, "dp_shard": 1, "world_size": 1}}}
        items = SaveItems(self.policy, None, None, None, None, {"steps": 10})
        self.manager.save(step, self.policy, self.optimizer, items, info)
        return self.manager.root / L.step_dir_name(step)


def test_names_and_paths(tmp_path: Path) -> None:
    assert L.step_dir_name(5000) == "005000"
    run = Run(tmp_path)
    run.save(3)
    config_path = tmp_path / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    assert L.checkpoint_dir_from_config_path(config_path) == (tmp_path / "checkpoints" / "000003").resolve()
    assert L.run_dir_from_checkpoint(tmp_path / "checkpoints" / "000003") == tmp_path.resolve()
    with pytest.raises(ValueError, match=r"config_path='.*config.json': expected <run>/checkpoints/<step or last>/"
                                         r"pretrained_model/train_config.json. Fix: config_path="):
        L.checkpoint_dir_from_config_path(tmp_path / "checkpoints" / "000003" / "pretrained_model" / "config.json")


def test_save_writes_the_guide_tree_and_moves_last(tmp_path: Path) -> None:
    run = Run(tmp_path)
    step_dir = run.save(4)
    assert step_dir == tmp_path / "checkpoints" / "000004"
    assert sorted(p.name for p in (step_dir / "pretrained_model").iterdir()) == [
        "config.json", "model.safetensors", "train_config.json"
    ]
    assert sorted(p.name for p in (step_dir / "training_state").iterdir()) == [
        "optimizer_param_groups.json", "optimizer_state.safetensors", "rng_state.safetensors", "training_step.json"
    ]
    assert os.readlink(tmp_path / "checkpoints" / "last") == "000004"
    assert json.loads((step_dir / "training_state" / "training_step.json").read_text())["step"] == 4


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    run = Run(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        run.save(step)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["000003", "000004", "last"]


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    """After a resume from an older checkpoint, the run saves a step that already exists."""
    run = Run(tmp_path)
    run.save(1)
    first = (tmp_path / "checkpoints" / "000001" / "pretrained_model" / "model.safetensors").read_bytes()
    run.save(1)
    assert (tmp_path / "checkpoints" / "000001" / "pretrained_model" / "model.safetensors").read_bytes() != first
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["000001", "last"]


def test_an_interrupted_save_leaves_last_on_the_previous_checkpoint(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(tmp_path)
    run.save(1)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("lerobot_mg.checkpoint.manager.pack_rank_states", crash)  # after the weights are written
    with pytest.raises(OSError, match="disk full"):
        run.save(2)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == [".tmp-000002", "000001", "last"]
    assert (root / ".tmp-000002" / "pretrained_model" / "model.safetensors").is_file()
    assert os.readlink(root / "last") == "000001"
    assert [d.name for d in L.complete_step_dirs(tmp_path)] == ["000001"]
    check_resumable((root / "last").resolve())

    monkeypatch.undo()
    run.save(3)  # the next save clears the leftovers
    assert sorted(os.listdir(root)) == ["000001", "000003", "last"]


def test_load_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    saved = Run(tmp_path)
    step_dir = saved.save(2)
    after_save = torch.rand(3)

    fresh = Run(tmp_path / "other")
    torch.manual_seed(123)
    fresh.manager.load(step_dir, fresh.policy, fresh.optimizer, None, None)

    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the saved run was
    for key, tensor in saved.policy.state_dict().items():
        assert torch.equal(fresh.policy.state_dict()[key], tensor), key
    expected = get_optimizer_state_dict(saved.policy, saved.optimizer)["state"]
    actual = get_optimizer_state_dict(fresh.policy, fresh.optimizer)["state"]
    assert actual.keys() == expected.keys()
    for fqn, per_param in expected.items():
        for name, value in per_param.items():
            assert torch.equal(actual[fqn][name], value), (fqn, name)


def test_optimizer_state_round_trips_through_flat_tensors() -> None:
    policy = tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    train_one_step(policy, optimizer)
    state = get_optimizer_state_dict(policy, optimizer)
    tensors, groups = flatten_optimizer_state(state)
    assert "state/model.action_head.weight/exp_avg" in tensors
    json.dumps(groups)  # param groups go to json
    restored = unflatten_optimizer_state(tensors, groups)
    assert restored["param_groups"] == state["param_groups"]
    for fqn, per_param in state["state"].items():
        for name, value in per_param.items():
            assert torch.equal(restored["state"][fqn][name], value)


def test_rng_state_round_trips_per_rank() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    first = capture_rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(2))
    second = capture_rng_state()
    per_rank = unpack_rank_states(pack_rank_states([first, second]))
    assert len(per_rank) == 2
    restore_rng_state(per_rank[0])
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(2), draws[2])


# --- check_resumable ------------------------------------------------------------------------------------


@pytest.fixture
def step_dir(tmp_path: Path) -> Path:
    return Run(tmp_path).save(4)


def _mark_sharded(step_dir: Path) -> None:
    marker = step_dir / "training_state" / "training_step.json"
    info = json.loads(marker.read_text())
    info["facts"]["topology"] = {"dp_replicate": 1, "dp_shard": 2, "world_size": 2}
    marker.write_text(json.dumps(info))


def test_check_resumable_accepts_a_complete_checkpoint(step_dir: Path) -> None:
    assert check_resumable(step_dir)["step"] == 4


def test_refuses_an_incomplete_checkpoint(step_dir: Path) -> None:
    (step_dir / "training_state" / "training_step.json").unlink()
    with pytest.raises(ValueError, match=r"training_step.json is missing: .* is not a complete checkpoint \(a save was "
                                         r"interrupted\). Fix: resume from config_path=.*/checkpoints/last/"):
        check_resumable(step_dir)


def test_refuses_a_checkpoint_without_run_facts(step_dir: Path) -> None:
    marker = step_dir / "training_state" / "training_step.json"
    marker.write_text(json.dumps({"step": 4, "topology": {"dp_shard": 1}}))  # the layout before RunFacts
    with pytest.raises(ValueError, match=r"training_step.json holds no run facts: the checkpoint was written by an older "
                                         r"lerobot_mg. Fix: resume it with that version"):
        check_resumable(step_dir)


def test_refuses_a_gathered_optimizer_state_of_a_sharded_run(step_dir: Path) -> None:
    _mark_sharded(step_dir)
    with pytest.raises(ValueError, match=r"optimizer_state.safetensors is a gathered full optimizer state of a sharded "
                                         r"run .* Fix: start a new run from the weights"):
        check_resumable(step_dir)


def test_refuses_missing_weight_shards(step_dir: Path) -> None:
    shards = step_dir / "pretrained_model" / "pytorch_model_fsdp_0"
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=shards, no_dist=True)
    (shards / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"pytorch_model_fsdp_0 has unusable shard file\(s\) \['__0_0.distcp \(missing\)'\]. "
                                          r"Fix: delete .*pytorch_model_fsdp_0 to resume from .*model.safetensors"):
        check_resumable(step_dir)
    (step_dir / "pretrained_model" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"Fix: resume from an earlier complete checkpoint \(config_path=.*\) or restore "
                                          r"the file from a copy"):
        check_resumable(step_dir)


def test_refuses_missing_optimizer_shards(step_dir: Path) -> None:
    _mark_sharded(step_dir)
    for name in ("optimizer_state.safetensors", "optimizer_param_groups.json"):
        (step_dir / "training_state" / name).unlink()
    shards = step_dir / "training_state" / "optimizer_0"
    dcp.save({"state": {"w": {"exp_avg": torch.zeros(3)}}}, checkpoint_id=shards, no_dist=True)
    check_resumable(step_dir)
    (shards / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"optimizer_0 has unusable shard file\(s\) \['__0_0.distcp \(missing\)'\]. Fix: "
                                          r"resume from an earlier complete checkpoint"):
        check_resumable(step_dir)


@pytest.mark.parametrize(
    ("removed", "message"),
    [
        (["pretrained_model/model.safetensors"], r"holds none of model.safetensors, adapter_model.safetensors, pytorch_model_fsdp_0/: no weights"),
        (["training_state/optimizer_state.safetensors"], r"holds no optimizer state \(optimizer_state.safetensors or "
                                                         r"optimizer_0/\)"),
        (["training_state/optimizer_param_groups.json"], r"optimizer_param_groups.json is missing"),
        (["training_state/rng_state.safetensors"], r"rng_state.safetensors is missing"),
    ],
)
def test_refuses_missing_files(step_dir: Path, removed: list[str], message: str) -> None:
    for name in removed:
        (step_dir / name).unlink()
    with pytest.raises(ValueError, match=message):
        check_resumable(step_dir)


def test_complete_step_dirs_skips_partial_and_temporary(tmp_path: Path) -> None:
    run = Run(tmp_path)
    for step in (2, 10):
        run.save(step)
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "000002", root / ".tmp-000011")
    shutil.copytree(root / "000002", root / "000012")
    (root / "000012" / "training_state" / "training_step.json").unlink()
    assert [d.name for d in L.complete_step_dirs(tmp_path)] == ["000002", "000010"]
