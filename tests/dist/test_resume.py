"""Resuming real runs: bit-exact on the same topology, resharded across FSDP-2 / HSDP-2x2 / 1 process, and
refused with a clear message when the checkpoint cannot be resumed.

Resumes run on copies of the reference runs of tests/dist/test_checkpoints.py (trained once per session).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import convert_checkpoint, read_dcp_tensors
from lerobot_mg.checkpoint.state import read_json
from tests.dist.test_checkpoints import REFERENCE_RUNS, SAVE_FREQ, copy_run, reference_run
from tests.launch_utils import run_train
from tests.tolerances import assert_same_series

pytestmark = pytest.mark.dist

RESUME_STEP = 4

# The real trainer, with CheckpointManager.load wrapped to write the full model and optimizer state right after
# a checkpoint is loaded (a collective on every rank, like the load itself).
PROBE_SCRIPT = '''
import os
from pathlib import Path

from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.checkpoint.state import flatten_optimizer_state
from lerobot_mg.scripts_entry import train

_load = CheckpointManager.load


def load_and_dump(self, step_dir, model, optimizer, scheduler, scaler):
    _load(self, step_dir, model, optimizer, scheduler, scaler)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if self.dims.is_main_process:  # the gathered states land on rank 0 only
        dump_dir = Path(os.environ["PROBE_DUMP_DIR"])
        dump_dir.mkdir(parents=True)
        save_file({k: v.clone().contiguous() for k, v in model_state.items()}, str(dump_dir / "model.safetensors"))
        save_file(flatten_optimizer_state(optimizer_state)[0], str(dump_dir / "optimizer.safetensors"))


CheckpointManager.load = load_and_dump
train()
'''


def resume_args(run_dir: Path, step: int | str) -> list[str]:
    step_name = step if isinstance(step, str) else L.step_dir_name(step)
    config = L.checkpoints_root(run_dir) / step_name / "pretrained_model" / "train_config.json"
    return ["resume=true", f"config_path={config}"]


def optimizer_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """The optimizer state of a checkpoint in either layout, keyed ``state/<param fqn>/<name>``."""
    training_state = step_dir / "training_state"
    if (training_state / "optimizer_0").is_dir():
        tensors = {}
        for key, tensor in read_dcp_tensors(training_state / "optimizer_0").items():
            section, rest = key.split(".", 1)  # DCP flattens {"state": {fqn: {name: ...}}} with dots
            fqn, name = rest.rsplit(".", 1)
            tensors[f"{section}/{fqn}/{name}"] = tensor
        return tensors
    return load_file(str(training_state / "optimizer_state.safetensors"))


def assert_tensors_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and torch.equal(actual[key], tensor), f"{what}: {key}"


def update_digests(run_dir: Path, after_step: int) -> list[tuple[int, str, int]]:
    return [(u.loop_step, u.digest, u.num_samples) for u in read_ledger(run_dir).updates if u.loop_step > after_step]


def assert_same_checkpoint(actual_dir: Path, expected_dir: Path) -> None:
    """Bit-identical weights, optimizer state, RNG streams, progress and schedules."""
    assert read_json(actual_dir / "training_state" / "training_step.json")["progress"] == (
        read_json(expected_dir / "training_state" / "training_step.json")["progress"]
    )
    for weights in ("pretrained_model/model.safetensors", "training_state/rng_state.safetensors"):
        if (expected_dir / weights).exists():
            assert_tensors_equal(load_file(str(actual_dir / weights)), load_file(str(expected_dir / weights)), weights)
    assert_tensors_equal(optimizer_tensors(actual_dir), optimizer_tensors(expected_dir), "optimizer state")
    for sidecar in ("optimizer_param_groups.json", "scheduler_state.json", "scaler_state.json"):
        if (expected_dir / "training_state" / sidecar).exists():
            assert read_json(actual_dir / "training_state" / sidecar) == read_json(
                expected_dir / "training_state" / sidecar
            )
    if (expected_dir / "pretrained_model" / "pytorch_model_fsdp_0").is_dir():
        assert_tensors_equal(read_dcp_tensors(actual_dir / "pretrained_model" / "pytorch_model_fsdp_0"),
                             read_dcp_tensors(expected_dir / "pretrained_model" / "pytorch_model_fsdp_0"), "DCP weights")


@pytest.mark.parametrize(("name", "async_save"), [*((name, False) for name in REFERENCE_RUNS),
                                                  ("single", True), ("fsdp2", True)])
def test_resume_is_bit_exact_on_the_same_topology(name: str, async_save: bool, tmp_path: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """N steps straight == RESUME_STEP steps, stop, resume to N: weights, optimizer, RNG, schedulers, samples.
    With checkpoint.async_save=true the resumed run writes its checkpoints in the background (fsdp2: step 8 while
    steps 9 and 10 train), and each is bit-identical to the synchronous reference's."""
    spec = REFERENCE_RUNS[name]
    reference = reference_run(tmp_path_factory, name)
    resumed = copy_run(reference, tmp_path / "resumed")
    proc = run_train([*resume_args(resumed, RESUME_STEP), f"checkpoint.async_save={str(async_save).lower()}"],
                     nproc=spec.nproc, timeout=240)
    assert f"Data sampler resumed sample-exact at epoch 0, sample offset {RESUME_STEP * 16}" in proc.stdout
    assert ("MiB staged in host memory" in proc.stdout) == async_save  # the per-checkpoint log line
    for step in range(2 * SAVE_FREQ, spec.steps, SAVE_FREQ):  # the checkpoints between the resume and the last
        assert_same_checkpoint(L.checkpoints_root(resumed) / L.step_dir_name(step),
                               L.checkpoints_root(reference) / L.step_dir_name(step))

    final = L.step_dir_name(spec.steps)
    expected_dir, actual_dir = L.checkpoints_root(reference) / final, L.checkpoints_root(resumed) / final
    assert_same_checkpoint(actual_dir, expected_dir)

    # The same global batches after the boundary, one digest per optimizer update.
    digests = update_digests(resumed, RESUME_STEP)
    assert len(digests) == spec.steps - RESUME_STEP
    assert digests == update_digests(reference, RESUME_STEP)
    assert read_ledger(resumed).segments[-1].start.progress.step == RESUME_STEP


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum((tensor.double() ** 2).sum() for tensor in tensors.values()) ** 0.5)


def _probe(tmp_path: Path, dump_name: str, overrides: list[str],
           nproc: int) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Resume through the probe; returns the log and the model and optimizer state right after the load."""
    probe = tmp_path / "resume_probe.py"
    probe.write_text(PROBE_SCRIPT)
    dump_dir = tmp_path / dump_name
    proc = run_train(overrides, nproc=nproc, timeout=240, env={"PROBE_DUMP_DIR": str(dump_dir)}, script=probe)
    return (proc.stdout, load_file(str(dump_dir / "model.safetensors")),
            load_file(str(dump_dir / "optimizer.safetensors")))


def test_resharding_fsdp_hsdp_single_and_back(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """FSDP-2 (steps 1-4) -> HSDP-2x2 (5-6) -> 1 process (7-8) -> FSDP-2 (9-10), global batch 16 throughout.

    Each load equals what was saved, bit for bit; the chained run sees the reference run's global batches and
    ends at its weights (up to float reduction order).
    """
    reference = reference_run(tmp_path_factory, "fsdp2")
    chain = copy_run(reference, tmp_path / "chain")
    ckpt = L.checkpoints_root(chain)

    log, model, optimizer = _probe(tmp_path, "hsdp_load", [
        *resume_args(chain, 4), "steps=6", "checkpoint.save_freq=2", "parallelism.dp_replicate=2",
        "parallelism.dp_shard=2", "batch_size=4"], nproc=4)
    assert_tensors_equal(model, load_file(str(ckpt / "000004/pretrained_model/model.safetensors")), "HSDP model")
    assert_tensors_equal(optimizer, optimizer_tensors(ckpt / "000004"), "HSDP optimizer")
    assert ("topology changed at resume (step 4): FSDP2: 2 shards -> HSDP: 2 replicas x 2 shards (mesh dp_replicate "
            "x dp_shard)") in log
    assert "Data sampler resumed global-batch-exact at epoch 0, sample offset 64: every optimizer update sees" in log

    log, model, optimizer = _probe(tmp_path, "single_load", [
        *resume_args(chain, 6), "steps=8", "parallelism.dp_shard=1", "parallelism.dp_replicate=1",
        "checkpoint.format=safetensors", "batch_size=16"], nproc=1)
    assert_tensors_equal(model, load_file(str(ckpt / "000006/pretrained_model/model.safetensors")), "1-proc model")
    assert_tensors_equal(optimizer, optimizer_tensors(ckpt / "000006"), "1-proc optimizer")
    assert "Data sampler resumed global-batch-exact at epoch 0, sample offset 96" in log
    assert (ckpt / "000008/training_state/optimizer_state.safetensors").is_file()  # non-sharded layout now

    log, model, optimizer = _probe(tmp_path, "fsdp_load", [
        *resume_args(chain, "last"), "steps=10", "parallelism.dp_shard=2", "checkpoint.format=safetensors_dcp",
        "batch_size=8"], nproc=2)
    assert_tensors_equal(model, load_file(str(ckpt / "000008/pretrained_model/model.safetensors")), "FSDP model")
    assert_tensors_equal(optimizer, optimizer_tensors(ckpt / "000008"), "FSDP optimizer")
    assert "Data sampler resumed global-batch-exact at epoch 0, sample offset 128" in log

    assert update_digests(chain, 0) == update_digests(reference, 0)
    # Not bit-exact across topologies (another split of the global batch sums in another order), but the same
    # training (bounds: tests/tolerances.py): measured loss differences ~1e-7 relative, weight drift ~3e-4 x the
    # weights' movement.
    chain_losses = {r.progress.step: r.metrics["loss"] for r in read_ledger(chain).intervals}
    reference_losses = {r.progress.step: r.metrics["loss"] for r in read_ledger(reference).intervals}
    assert chain_losses.keys() == reference_losses.keys() == {2, 4, 6, 8, 10}
    steps = sorted(reference_losses)  # each interval's loss averages loop steps step-1 and step
    assert_same_series([chain_losses[s] for s in steps], [reference_losses[s] for s in steps],
                       [s - 1 for s in steps], "interval loss")
    start = load_file(str(L.checkpoints_root(reference) / "000004/pretrained_model/model.safetensors"))
    expected = load_file(str(L.checkpoints_root(reference) / "000010/pretrained_model/model.safetensors"))
    actual = load_file(str(ckpt / "000010/pretrained_model/model.safetensors"))
    assert actual.keys() == expected.keys()
    drift = _norm({key: actual[key] - expected[key] for key in expected})
    movement = _norm({key: expected[key] - start[key] for key in expected})
    assert drift < 0.01 * movement, (drift, movement)

    # HSDP shards (replicated across the 2 replicas) merge offline into exactly the gathered weights.
    gathered = load_file(str(ckpt / "000006/pretrained_model/model.safetensors"))
    merged = load_file(str(convert_checkpoint(ckpt / "000006")))
    assert_tensors_equal(merged, gathered, "merged HSDP shards")


def test_resume_refuses_a_checkpoint_with_missing_shards(tmp_path: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """The error names the file and the remedy, and comes before any training (truncated shards and files, and a
    training_step.json missing keys, go through the same check: tests/unit/test_checkpoint_io.py)."""
    run_dir = copy_run(reference_run(tmp_path_factory, "fsdp2"), tmp_path / "broken")
    optimizer_dir = L.checkpoints_root(run_dir) / "000004" / "training_state" / "optimizer_0"
    (optimizer_dir / "__1_0.distcp").unlink()
    ledger_before = (run_dir / "ledger.jsonl").read_text()

    proc = run_train([*resume_args(run_dir, 4), "parallelism.dp_shard=1", "checkpoint.format=safetensors"],
                     timeout=120, check=False)
    assert proc.returncode != 0
    assert (f"ConfigError: {optimizer_dir} has unusable shard file(s) ['__1_0.distcp (missing)']. Fix: resume from an "
            "earlier complete checkpoint") in proc.stdout
    assert (run_dir / "ledger.jsonl").read_text() == ledger_before  # nothing ran


def test_resume_refuses_a_gathered_optimizer_state_of_a_sharded_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The LeRobot <= 0.6.x FSDP layout: a full optimizer state file in a sharded run's training_state."""
    run_dir = copy_run(reference_run(tmp_path_factory, "fsdp2"), tmp_path / "old_layout")
    training_state = L.checkpoints_root(run_dir) / "000004" / "training_state"
    single = L.checkpoints_root(reference_run(tmp_path_factory, "single")) / "000004"
    shutil.rmtree(training_state / "optimizer_0")
    for name in ("optimizer_state.safetensors", "optimizer_param_groups.json"):
        shutil.copy(single / "training_state" / name, training_state / name)

    proc = run_train([*resume_args(run_dir, 4), "parallelism.dp_shard=1", "checkpoint.format=safetensors"],
                     timeout=120, check=False)
    assert proc.returncode != 0
    assert (f"ConfigError: {training_state / 'optimizer_state.safetensors'} is a gathered full optimizer state of a "
            "sharded run") in proc.stdout
    assert "Fix: start a new run from the weights" in proc.stdout
    assert json.loads((run_dir / "ledger.jsonl").read_text().splitlines()[-1])["kind"] != "resume"
