"""Evaluation during training on every layout: DDP-2, FSDP-2 and HSDP-2x2 runs with EMA weights evaluate them every
2 loop steps (3 rollouts of 12 steps in simulation, spread over the ranks, and the loss of 3 validation batches on a
held-out episode); each evaluation equals a one-process evaluation of the checkpoint saved at that step (its
pretrained_model_ema/), the training weights are bit-identical to a run that never evaluates, keep_best keeps the
right checkpoints, and a rollout that crashes on one rank fails the run at once, naming the rank and the seed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.evaluation import ValidationBatches, validation_loss
from lerobot_mg.policies.base import delta_timestamps
from lerobot_mg.sim.evaluate import PolicyController, rollout_episodes
from tests.launch_utils import interval_metrics, run_train

pytestmark = pytest.mark.sim

PROBE = Path(__file__).with_name("eval_crash_probe.py")
SEEDS = [100_000, 100_001, 100_002]
MAX_STEPS, VAL_BATCH, VAL_BATCHES, SEED = 12, 8, 3, 1000
TINY = ["experiment=aloha_state", "logging.progress_bar=false", "logging.wandb.mode=disabled", "log_freq=2",
        "batch_size=4", "scheduler.num_warmup_steps=0", "policy.dim_model=32", "policy.n_heads=2",
        "policy.dim_feedforward=64", "policy.n_encoder_layers=1", "policy.chunk_size=10", "policy.n_action_steps=5",
        "checkpoint.save_freq=2", f"seed={SEED}"]
EVALUATING = ["eval.freq=2", "eval.n_episodes=3", f"eval.max_steps={MAX_STEPS}", "eval.n_video_episodes=0",
              "dataset.val_episodes=1", f"eval.val_batches={VAL_BATCHES}", f"eval.val_batch_size={VAL_BATCH}",
              "ema.enable=true"]  # evaluations roll out the EMA weights (ema.use_for_eval)
LAYOUTS = {  # name -> (processes, overrides)
    "ddp": (2, ["steps=6", "checkpoint.keep_last=1", "checkpoint.keep_best=2", "checkpoint.best_metric=val_loss"]),
    "fsdp": (2, ["steps=4", "parallelism.dp_shard=2"]),
    "hsdp": (4, ["steps=4", "parallelism.dp_replicate=2", "parallelism.dp_shard=2"]),
}


def _one_process_evaluation(step_dir: Path, root: Path) -> tuple[list[dict], float]:
    """The checkpoint's rollouts and validation loss, computed here in one process as lerobot-mg-eval does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs (experiment=aloha_state: torch_threads=1)
    try:
        controller = PolicyController.load(step_dir / "pretrained_model_ema")  # what lerobot-mg-eval picks
        episodes, _ = rollout_episodes(controller, SEEDS, max_steps=MAX_STEPS)
        policy, meta = controller.policy, DatasetMeta.read(root)
        val = LeRobotDataset(meta, delta_timestamps(policy.config, meta.features, meta.fps), [2],
                             keys=[*policy.input_features, *policy.output_features], uint8_visuals=True)
        sums = ValidationBatches(val, VAL_BATCH, SEED, VAL_BATCHES).loss_sums(
            policy, controller.preprocessor, torch.device("cpu"), rank=0, world_size=1)
    finally:
        torch.set_num_threads(threads)
    return [asdict(e) for e in episodes], validation_loss(sums)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_evaluation_spread_over_the_ranks_equals_one_process(layout: str, state_dataset: tuple[Path, dict],
                                                            tmp_path: Path) -> None:
    root, _ = state_dataset
    nproc, overrides = LAYOUTS[layout]
    run_dir = tmp_path / layout
    proc = run_train([*TINY, *EVALUATING, *overrides, f"dataset.root={root}", f"output_dir={run_dir}"], nproc=nproc,
                     timeout=400)
    evals = read_ledger(run_dir).evals
    steps = int(next(o for o in overrides if o.startswith("steps=")).split("=")[1])
    assert [e.progress.step for e in evals] == list(range(2, steps + 1, 2))
    assert len({e.metrics.val_loss for e in evals}) == len(evals)  # each evaluated the weights of its own step
    for record in evals:
        step, metrics = record.progress.step, record.metrics
        info = json.loads((run_dir / "eval" / f"{step:06d}" / "eval_info.json").read_text())
        assert [e["seed"] for e in info["per_episode"]] == SEEDS  # the same seeds whatever the world size
        assert metrics.n_episodes == 3 and metrics.num_successes == sum(e["success"] for e in info["per_episode"])
        assert metrics.val_samples == VAL_BATCH * VAL_BATCHES and metrics.val_loss == info["val_loss"]
        assert record.progress.samples_seen == step * 4 * nproc  # batch_size x data-parallel workers per step
        assert f"eval at loop step {step} (" in proc.stdout
        step_dir = run_dir / "checkpoints" / f"{step:06d}"
        if step_dir.is_dir():  # keep_best pruned some of the ddp run's
            episodes, val_loss = _one_process_evaluation(step_dir, root)
            assert info["per_episode"] == episodes, step  # rewards, lengths and the sum of every action taken
            assert metrics.val_loss == val_loss, step  # exact: summed by batch, in batch order
    final = json.loads((run_dir / "eval_info.json").read_text())
    assert final["per_episode"] == info["per_episode"]
    if layout == "ddp":  # keep_last=1 and keep_best=2 by the validation loss
        ranked = sorted(evals, key=lambda e: e.metrics.val_loss)
        kept = sorted({steps, *(e.progress.step for e in ranked[:2])})
        checkpoints = run_dir / "checkpoints"
        assert sorted(int(d.name) for d in checkpoints.iterdir() if d.name.isdigit()) == kept
        assert (checkpoints / "best").resolve().name == f"{ranked[0].progress.step:06d}"
        assert (checkpoints / "last").resolve().name == f"{steps:06d}"
        best = json.loads((checkpoints / "best" / "training_state" / "eval_metrics.json").read_text())
        assert best["val_loss"] == ranked[0].metrics.val_loss
    if layout == "fsdp":  # the same run without any evaluation trains on the same episodes: the same weights
        reference = tmp_path / "fsdp_without_eval"
        run_train([*TINY, *overrides, "eval.freq=0", "eval.n_episodes=0", "ema.enable=true", "dataset.episodes=[0,1]",
                   f"dataset.root={root}", f"output_dir={reference}"], nproc=nproc, timeout=400)
        assert not (reference / "eval").exists()
        for step in (2, 4):
            ours, theirs = (load_file(str(d / "checkpoints" / f"{step:06d}" / "pretrained_model" /
                                          "model.safetensors")) for d in (run_dir, reference))
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[key], theirs[key]) for key in ours), step
        assert [m["loss"] for m in interval_metrics(run_dir)] == [m["loss"] for m in interval_metrics(reference)]


@pytest.mark.parametrize("layout", [[], ["parallelism.dp_shard=2"]], ids=["ddp", "fsdp"])
def test_a_crashing_rollout_fails_the_run_naming_rank_and_seed(layout: list[str], state_dataset: tuple[Path, dict],
                                                               tmp_path: Path) -> None:
    """Rank 1's simulator raises on seed 100001 (tests/sim/eval_crash_probe.py): the failure travels in the
    evaluation's gather, so both ranks stop at the evaluation step with the rank and seed. Rank 0 raising the same
    EvaluationError shows it did not wait for the process group's timeout: a rank left waiting would fail with the
    group's timeout error instead. Sharded, rank 0's rollouts go on through the sharded model, rank 1 keeping pace."""
    root, _ = state_dataset
    proc = run_train([*TINY, *EVALUATING, *layout, "steps=2", "accelerator.process_group_timeout_s=120",
                      f"dataset.root={root}", f"output_dir={tmp_path / 'run'}"], nproc=2, timeout=300, check=False,
                     script=PROBE)
    assert proc.returncode != 0
    failure = ("lerobot_mg.evaluation.EvaluationError: evaluation at loop step 2 failed: rank 1, episode seed 100001: "
               "RuntimeError('eval crash probe")
    for rank in (0, 1):
        report = proc.stdout.split(f"rank {rank} of 2 (", 1)[-1]
        assert report != proc.stdout and failure in report.split("lerobot-mg-train: rank", 1)[0], proc.stdout[-6000:]
