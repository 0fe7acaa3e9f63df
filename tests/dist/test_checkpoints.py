"""Checkpoints of real runs: the guide's tree for 1 process, DDP, FSDP2 and HSDP, the DCP converter on real
shards, a SIGKILL in the middle of a save in every format (and of a background save), and a disk that refuses
the save.

The reference runs are shared with tests/dist/test_resume.py through ``reference_run`` (each is trained once
per session and only read afterwards; a test that resumes one works on a copy).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import read_dcp_tensors
from lerobot_mg.checkpoint.resume import check_resumable
from lerobot_mg.checkpoint.state import read_json
from lerobot_mg.peft.lora import load_policy
from tests.launch_utils import (
    REPO,
    TINY_RUN,
    clean_env,
    descendants,
    kill_tree,
    launch_command,
    run_train,
    shared_by_workers,
)

pytestmark = pytest.mark.dist


@dataclass(frozen=True)
class ReferenceRun:
    nproc: int
    steps: int
    overrides: tuple[str, ...]


SAVE_FREQ = 4
# Every reference run (and every test that reruns one with spec.overrides): the resumed chains change the world
# size, and LeRobot's per-rank masked L1 would weigh each rank's samples by its padding (tests/dist/conftest.py).
PER_SAMPLE_L1 = "policy.l1_reduction=per_sample"
# Every sharded run keeps the global batch at 16 (batch_size x dp_world_size), so runs on different topologies
# see the same stream of global batches and test_resume can chain them.
REFERENCE_RUNS = {
    "single": ReferenceRun(1, 8, ("batch_size=16", PER_SAMPLE_L1)),
    "ddp2_fp16": ReferenceRun(2, 8, ("accelerator.mixed_precision=fp16", PER_SAMPLE_L1)),
    # No dropout and no VAE sampling: with per-rank noise gone, a run resharded to another topology must land on
    # this run's weights up to float reduction order (test_resume).
    "fsdp2": ReferenceRun(2, 10, ("parallelism.dp_shard=2", "checkpoint.format=safetensors_dcp", "policy.dropout=0.0",
                                  "policy.use_vae=false", PER_SAMPLE_L1)),
    "hsdp2x2_bf16": ReferenceRun(
        4, 8, ("parallelism.dp_replicate=2", "parallelism.dp_shard=2", "batch_size=4", "accelerator.mixed_precision=bf16",
               PER_SAMPLE_L1)
    ),
}


def reference_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """The run directory of ``REFERENCE_RUNS[name]``, trained once per session on first use (by whichever xdist
    worker needs it first)."""
    spec = REFERENCE_RUNS[name]
    with shared_by_workers(tmp_path_factory, f"reference_runs/{name}") as run_dir:
        final = L.checkpoints_root(run_dir) / L.step_dir_name(spec.steps) / L.TRAINING_STATE_DIR / L.TRAINING_STEP
        if not final.is_file():
            shutil.rmtree(run_dir, ignore_errors=True)
            run_train(
                [*TINY_RUN, f"steps={spec.steps}", f"checkpoint.save_freq={SAVE_FREQ}", "log_freq=2",
                 f"output_dir={run_dir}", *spec.overrides],
                nproc=spec.nproc, timeout=240,
            )
        return run_dir


def copy_run(run_dir: Path, destination: Path) -> Path:
    """A private copy to resume in (a resume writes into the run directory of its checkpoint)."""
    shutil.copytree(run_dir, destination, symlinks=True)
    return destination


def file_tree(directory: Path) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*")}


PROCESSOR_FILES = {
    "policy_preprocessor.json", "policy_preprocessor_step_3_normalizer_processor.safetensors",
    "policy_postprocessor.json", "policy_postprocessor_step_0_unnormalizer_processor.safetensors",
}
PRETRAINED_COMMON = {"config.json", "train_config.json", *PROCESSOR_FILES}
TRAINING_STATE_COMMON = {"rng_state.safetensors", "scheduler_state.json", "training_step.json"}


def dcp_files(name: str, world_size: int) -> set[str]:
    return {name, f"{name}/.metadata", *(f"{name}/__{rank}_0.distcp" for rank in range(world_size))}


EXPECTED_TREES = {
    "single": (
        PRETRAINED_COMMON | {"model.safetensors"},
        TRAINING_STATE_COMMON | {"optimizer_param_groups.json", "optimizer_state.safetensors"},
    ),
    "ddp2_fp16": (
        PRETRAINED_COMMON | {"model.safetensors"},
        TRAINING_STATE_COMMON | {"optimizer_param_groups.json", "optimizer_state.safetensors", "scaler_state.json"},
    ),
    "fsdp2": (
        PRETRAINED_COMMON | {"model.safetensors"} | dcp_files("pytorch_model_fsdp_0", 2),
        TRAINING_STATE_COMMON | dcp_files("optimizer_0", 2),
    ),
    "hsdp2x2_bf16": (
        PRETRAINED_COMMON | {"model.safetensors"},
        TRAINING_STATE_COMMON | dcp_files("optimizer_0", 4),
    ),
}
EXPECTED_TOPOLOGY = {  # (layout, dp_replicate, dp_shard, world_size, batch_size, precision)
    "single": ("single", 1, 1, 1, 16, "no"),
    "ddp2_fp16": ("ddp", 2, 1, 2, 8, "fp16"),
    "fsdp2": ("fsdp", 1, 2, 2, 8, "no"),
    "hsdp2x2_bf16": ("hsdp", 2, 2, 4, 4, "bf16"),
}


@pytest.mark.parametrize("name", list(REFERENCE_RUNS))
def test_checkpoint_tree_matches_the_guide(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = REFERENCE_RUNS[name]
    run_dir = reference_run(tmp_path_factory, name)
    root = L.checkpoints_root(run_dir)
    saved_steps = sorted({*range(SAVE_FREQ, spec.steps + 1, SAVE_FREQ), spec.steps})
    assert sorted(os.listdir(root)) == [*(f"{step:06d}" for step in saved_steps), "last"]
    assert os.readlink(root / "last") == f"{spec.steps:06d}"  # relative: the run directory can be moved

    pretrained_files, training_state_files = EXPECTED_TREES[name]
    for step in saved_steps:
        step_dir = root / f"{step:06d}"
        assert file_tree(step_dir / "pretrained_model") == pretrained_files, step_dir
        assert file_tree(step_dir / "training_state") == training_state_files, step_dir

    layout, dp_replicate, dp_shard, world_size, batch_size, precision = EXPECTED_TOPOLOGY[name]
    last = root / "last"
    info = read_json(last / "training_state" / "training_step.json")
    assert info["step"] == spec.steps
    facts = info["facts"]
    assert facts["batch"] == {"batch_size": batch_size, "dp_world_size": dp_replicate * dp_shard, "grad_accum_steps": 1,
                              "effective_batch_size": dp_replicate * dp_shard * batch_size}
    assert facts["precision"] == precision
    assert facts["topology"] == {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "world_size": world_size,
                                 "layout": layout}
    assert len(facts["code_revision"]["commit"]) == 40
    assert len(facts["dataset_fingerprint"]) >= 8
    assert info["progress"]["step"] == info["progress"]["optimizer_updates"] == spec.steps
    assert info["sampler"]["offset"] == (spec.steps * 16) % 416  # 420 frames, drop_last to 26 global batches of 16

    # Every rank's RNG state, without pickle.
    rng = load_file(str(last / "training_state" / "rng_state.safetensors"))
    assert {key.split("/")[0] for key in rng} == {f"rank{rank}" for rank in range(world_size)}
    torch_streams = {bytes(rng[f"rank{rank}/torch_cpu"].numpy()) for rank in range(world_size)}
    assert len(torch_streams) == world_size  # seeded per rank: no two ranks share a stream

    # Gathered weights are the fp32 master copy, whatever the training precision.
    weights = load_file(str(last / "pretrained_model" / "model.safetensors"))
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    if precision == "fp16":
        scaler = read_json(last / "training_state" / "scaler_state.json")
        # The scaler starts at 2**16 and halves on every skipped update.
        assert scaler["scale"] == 2.0**16 / 2 ** info["progress"]["skipped_updates"]
    assert check_resumable(last.resolve())["step"] == spec.steps


def test_dcp_converter_matches_gathered_weights(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    run_dir = reference_run(tmp_path_factory, "fsdp2")
    step_dir = shutil.copytree(L.checkpoints_root(run_dir) / "000004", tmp_path / "000004")
    pretrained = step_dir / "pretrained_model"
    gathered = load_file(str(pretrained / "model.safetensors"))
    (pretrained / "model.safetensors").unlink()

    proc = run_train([f"--checkpoint_dir={step_dir}", "--delete_dcp=true"], script=REPO / "scripts" / "convert_dcp.py",
                     timeout=120)
    assert f"wrote {pretrained / 'model.safetensors'}" in proc.stdout
    assert not (pretrained / "pytorch_model_fsdp_0").exists()
    merged = load_file(str(pretrained / "model.safetensors"))
    assert merged.keys() == gathered.keys()
    for key, tensor in gathered.items():
        assert merged[key].dtype == tensor.dtype and torch.equal(merged[key], tensor), key

    policy = load_policy(pretrained)
    for key, tensor in policy.state_dict().items():
        assert torch.equal(tensor, gathered[key]), key


def test_optimizer_shards_read_offline_match_the_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The offline DCP reader sees the full AdamW state of every parameter, keyed by parameter FQN."""
    run_dir = reference_run(tmp_path_factory, "fsdp2")
    step_dir = L.checkpoints_root(run_dir) / "000010"
    weights = load_file(str(step_dir / "pretrained_model" / "model.safetensors"))
    optimizer = read_dcp_tensors(step_dir / "training_state" / "optimizer_0")
    params = set(load_policy(step_dir / "pretrained_model").state_dict()) & set(weights)
    for fqn in params:
        assert optimizer[f"state.{fqn}.exp_avg"].shape == weights[fqn].shape
        assert float(optimizer[f"state.{fqn}.step"]) == 10.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_until(condition: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None,
                log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"watchdog: no {what} within {timeout}s\n{log_path.read_text()[-4000:]}")
        time.sleep(0.0005)


@dataclass(frozen=True)
class KillDrill:
    nproc: int
    overrides: tuple[str, ...]
    written_first: str  # a glob, under the interrupted step directory, of a file the save writes early


KILL_DRILLS = {  # every format once; the dcp format is killed while the background writer writes it
    # The gathered layout on one process: model.safetensors and optimizer_state.safetensors.
    "safetensors": KillDrill(1, ("checkpoint.format=safetensors", "batch_size=16"), "*/*.safetensors"),
    # FSDP-2: DCP shards written by every rank, and the gathered model.safetensors.
    "safetensors_dcp": KillDrill(2, ("checkpoint.format=safetensors_dcp", "parallelism.dp_shard=2"), "*/*/*.distcp"),
    # FSDP-2, asynchronous: killed while the background writer writes the shards, training having gone on meanwhile.
    "dcp_async": KillDrill(2, ("checkpoint.format=dcp", "parallelism.dp_shard=2", "checkpoint.async_save=true"),
                           "*/*/*.distcp"),
}


@pytest.mark.parametrize("drill", list(KILL_DRILLS))
def test_sigkill_during_save_leaves_last_resumable(drill: str, tmp_path: Path) -> None:
    """Kill every process of a run while a checkpoint is being written: `last` stays on a complete checkpoint,
    resume ignores the partial one and the next start removes it."""
    spec = KILL_DRILLS[drill]
    run_dir = tmp_path / "killed"
    root = L.checkpoints_root(run_dir)
    cmd = [*launch_command(spec.nproc, "torchrun" if spec.nproc > 1 else "python"), *TINY_RUN, "steps=2000",
           "checkpoint.save_freq=1", "checkpoint.keep_last=2", "log_freq=1000", f"output_dir={run_dir}",
           *spec.overrides]
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        _wait_until(lambda: (root / "last").is_symlink() and int(os.readlink(root / "last")) >= 2, 180,
                    "second checkpoint", proc, log_path)

        def save_being_written() -> bool:  # the step directory exists, without its completion marker, with data
            return any(any(tmp.glob(spec.written_first)) for tmp in root.glob(".tmp-0*"))

        interrupted: list[str] = []
        for _ in range(50):  # how long a save takes is the machine's: one caught in the act, however many tries
            _wait_until(save_being_written, 60, "save in progress", proc, log_path)
            workers = descendants(proc.pid) if spec.nproc > 1 else [proc.pid]
            for pid in workers:  # freeze the ranks first, so the save cannot complete while the tree is killed
                os.kill(pid, signal.SIGSTOP)
            interrupted = sorted(path.name for path in root.glob(".tmp-0*"))
            if interrupted:
                break
            for pid in workers:  # the save completed between the look and the freeze: let the run go on, look again
                os.kill(pid, signal.SIGCONT)
    finally:
        kill_tree(proc)
    assert len(workers) == spec.nproc, workers
    _wait_until(lambda: not any(_alive(pid) for pid in workers), 30, "end of the killed ranks", None, log_path)

    assert interrupted, "every save completed before the kill (50 tries): no interrupted checkpoint to test"
    last = (root / "last").resolve()
    assert int(interrupted[0].removeprefix(".tmp-")) > int(last.name)  # `last` stayed on the complete one
    assert last.parent == root and last.name.isdigit()
    last_step = int(last.name)
    info = check_resumable(last)  # the checkpoint `last` names is complete
    assert info["step"] == last_step
    assert [d.name for d in L.complete_step_dirs(run_dir)][-1] == last.name

    # Resume on one process (DCP shards reshard to it) and finish two more steps.
    resumed = run_train(
        ["resume=true", f"config_path={root / 'last' / 'pretrained_model' / 'train_config.json'}",
         f"steps={last_step + 2}", "parallelism.dp_shard=1", "checkpoint.format=safetensors", "batch_size=16",
         "checkpoint.async_save=false"],
        timeout=120,
    )
    assert f"resumed at loop step {last_step}" in resumed.stdout
    for name in interrupted:  # the next start removed the partial save and said so
        assert f"Removing {root / name}: a checkpoint save that never completed" in resumed.stdout
    assert os.readlink(root / "last") == f"{last_step + 2:06d}"
    # keep_last=2 prunes older checkpoints; the interrupted save's leftovers are gone.
    assert sorted(os.listdir(root)) == [f"{last_step + 1:06d}", f"{last_step + 2:06d}", "last"]


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_disk_that_refuses_the_save_stops_the_run_and_keeps_the_previous_checkpoint(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A real failed write: the kernel refuses any file past RLIMIT_FSIZE (EFBIG), below the size of
    model.safetensors and above everything else the run writes. Resumed from step 4, the run's save of step 8 fails;
    the step-8 checkpoint saved before (`last`) stays whole."""
    run_dir = copy_run(reference_run(tmp_path_factory, "single"), tmp_path / "full")
    root = L.checkpoints_root(run_dir)
    weights = root / "000008" / "pretrained_model" / "model.safetensors"
    before = {path: path.read_bytes() for path in (root / "000008").rglob("*") if path.is_file()}
    config = root / "000004" / "pretrained_model" / "train_config.json"
    cmd = [*launch_command(1, "python"), "resume=true", f"config_path={config}"]
    proc = subprocess.run(cmd, env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, preexec_fn=_limit_file_size(weights.stat().st_size // 2))
    assert proc.returncode != 0
    assert f"ConfigError: could not write checkpoint {root / '.tmp-000008'}: " in proc.stdout, proc.stdout[-3000:]
    assert "File too large" in proc.stdout
    message = proc.stdout.rsplit("ConfigError: ", 1)[1]
    assert f"bytes on this rank; the previous checkpoint {root / '000008'} is intact. Fix: free space" in message
    assert os.readlink(root / "last") == "000008"
    assert {path: path.read_bytes() for path in (root / "000008").rglob("*") if path.is_file()} == before
    assert not (root / ".tmp-000008").exists()
    check_resumable(root / "last")
