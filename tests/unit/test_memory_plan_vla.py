"""The memory plan of a policy shaped like full-size pi0 (tests/joint_toy.py with PI0_SIZES on the meta device:
4,028,019,472 parameters, 18 joint units, 27 SigLIP layers, language-model heads that no pass reads), for the
layouts a user shards it on: the per-rank persistent state falls as 1/N, and the plan counts what a step and an
evaluation hold for a while."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.distributed.memory import MemoryPlan, plan_memory, plan_table
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.policies import make_policy
from tests.joint_toy import PI0_SIZES, Sizes, ToyJointPolicy

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (2, 8)]  # (dp_replicate, dp_shard)


@functools.cache
def _pi0() -> ToyJointPolicy:
    """Built once (seconds, even on the meta device); planning leaves it as it was."""
    with torch.device("meta"):
        return ToyJointPolicy(PI0_SIZES)


@functools.cache
def _pi0_without_example() -> ToyJointPolicy:
    """The same shapes without ``example_batch``: plans of the persistent state only (no activation estimate, a
    meta-device forward of ~2 s each)."""
    with torch.device("meta"):
        policy = ToyJointPolicy(PI0_SIZES)
    policy.example_batch = None
    return policy


def _cfg(mixed_precision: str, accumulation: int = 1, n_episodes: int = 0) -> TrainConfig:
    cfg = TrainConfig()
    cfg.batch_size = 4
    cfg.accelerator.mixed_precision = mixed_precision
    cfg.accelerator.gradient_accumulation.steps = accumulation
    cfg.eval.n_episodes = n_episodes
    return cfg


def _plan(cfg: TrainConfig, dp_replicate: int, dp_shard: int, policy: ToyJointPolicy | None = None) -> MemoryPlan:
    world = dp_replicate * dp_shard
    return plan_memory(cfg, ParallelDims.resolve(dp_replicate, dp_shard, world, launched=world > 1),
                       policy or _pi0())


def _label(dp_replicate: int, dp_shard: int) -> str:
    if dp_replicate * dp_shard == 1:
        return "1 process"
    return f"FSDP-{dp_shard}" if dp_replicate == 1 else f"HSDP {dp_replicate}x{dp_shard}"


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_per_rank_state_of_pi0_falls_as_one_over_n(precision: str) -> None:
    for n in (2, 4, 8, 16):
        policy = _pi0_without_example()
        sharded, replicated = _plan(_cfg(precision), 1, n, policy), _plan(_cfg(precision), n, 1, policy)
        ratio = sharded.busiest.total / replicated.busiest.total
        assert ratio <= 1 / n + 0.02, (n, precision, ratio)


def test_the_pi0_plan_counts_its_parameters_units_and_transient_memory() -> None:
    plan = _plan(_cfg("bf16", accumulation=4, n_episodes=10), 2, 8)
    lines = plan.describe()
    assert "  parameters: 4,028,019,472" in lines
    vlm = "model.paligemma_with_expert.paligemma.model.language_model.layers"
    expert = "model.paligemma_with_expert.gemma_expert.model.layers"
    assert f"  joint units: 18 ({vlm}.i + {expert}.i), e.g. {vlm}.17 + {expert}.17" in lines
    extra = plan.transient
    assert extra is not None
    # The largest unit is a joint layer (both layers, in bf16); the root holds the token embedding.
    vlm_layer = 2048 * 2048 + 2 * 2048 * 256 + 2048 * 2048 + 3 * 2048 * 16384 + 2 * 2048
    expert_layer = 1024 * 2048 + 2 * 1024 * 256 + 2048 * 1024 + 3 * 1024 * 4096 + 2 * 1024
    assert f"({vlm}.0 + {expert}.0: {vlm_layer + expert_layer:,})" in extra.gathered_what
    # The lm_heads (789,970,944 parameters) are units of their own, never gathered: not in the root.
    root = 257152 * 2048 + 588 * 1152 + 1152 + 256 * 1152 + 2 * 1152 + 1152 * 2048 + 2048 + 2048 + 1024 + (
        32 * 1024 + 1024) * 2 + 1024 * 32 + 32 + 2048 * 1024 + 1024 + 1024 * 1024 + 1024
    assert f"root unit {root:,} parameters" in extra.gathered_what
    assert extra.gathered == 2 * (root + root + 2 * (vlm_layer + expert_layer) + vlm_layer + expert_layer)
    assert extra.activations is not None and extra.activations.total > 0
    assert extra.evaluation == 0  # through the sharded model
    assert extra.accumulation > 0  # HSDP's shard waiting for the replica all-reduce
    unsharded = _plan(_cfg("bf16", n_episodes=10), 8, 1)
    assert unsharded.transient is not None and unsharded.transient.evaluation == 4_028_019_472 * 4
    assert unsharded.transient.gathered == unsharded.busiest.gradients  # DDP's reducer buckets: a gradient copy


def test_checkpointing_shrinks_the_activation_estimate() -> None:
    sizes = Sizes(num_layers=4)
    plain, checkpointed = _cfg("no"), _cfg("no")
    checkpointed.accelerator.activation_checkpointing = True
    with torch.device("meta"):
        full = _plan(plain, 1, 2, ToyJointPolicy(sizes)).transient
        recomputed = _plan(checkpointed, 1, 2, ToyJointPolicy(sizes)).transient
    assert full is not None and recomputed is not None
    assert full.activations is not None and recomputed.activations is not None
    assert full.activations.total is not None and recomputed.activations.total is not None
    assert recomputed.activations.total < full.activations.total
    assert "4 checkpointed blocks" in recomputed.activations.how


def test_print_the_pi0_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The table of docs/sharding.md (run with -s to see it)."""
    policy = _pi0()
    rows = []
    for precision, words in (("no", "fp32"), ("bf16", "bf16")):
        for dp_replicate, dp_shard in LAYOUTS:
            rows.append((f"{_label(dp_replicate, dp_shard)} {words}",
                         _plan(_cfg(precision, accumulation=4, n_episodes=10), dp_replicate, dp_shard, policy)))
    table = plan_table(rows)
    print("\n".join(table))
    assert len(table) == 2 + 12
    cells = {row.split(" | ")[0].lstrip("| "): row.strip(" |").split(" | ")[1:] for row in table[2:]}
    for words in ("fp32", "bf16"):
        whole = cells[f"1 process {words}"]
        assert whole[4] == "0.00" and whole[6] == "15.01"  # nothing gathered; a whole fp32 copy to evaluate
        for n in (2, 4, 8, 16):
            sharded = cells[f"FSDP-{n} {words}"]
            assert abs(float(sharded[3]) - float(whole[3]) / n) <= 0.01  # persistent: 1/N of one process's
            assert sharded[6] == "0.00" and sharded[7] == "0.00"  # no evaluation copy, no window beyond .grad
        assert float(cells[f"HSDP 2x8 {words}"][7]) > 0  # the shard waiting for the replica all-reduce
    assert float(cells["FSDP-2 bf16"][4]) * 2 == pytest.approx(float(cells["FSDP-2 fp32"][4]), abs=0.011)


def test_the_real_pi0_plans_as_its_shape_does() -> None:
    """LeRobot's full-size pi0 (our build, on the meta device): the plan counts exactly its parameters, its 18
    joint units, and its per-rank state falls as 1/N; frozen unused parameters hold no gradient or moment."""
    features = {"observation.images.top": {"dtype": "video", "shape": [224, 224, 3]},
                "observation.state": {"dtype": "float32", "shape": [8]}, "action": {"dtype": "float32", "shape": [7]}}
    with torch.device("meta"):
        policy = make_policy(PI0Config(), features)
    policy.example_batch = None  # the persistent state only (the activation estimate is the table test's)
    plan = _plan(_cfg("no"), 1, 8, policy)
    lines = plan.describe()
    assert "  parameters: 4,028,019,472" in lines
    assert any(line.startswith("  joint units: 18 (") for line in lines)
    unused = sum(p.numel() for name, p in policy.named_parameters() if name in set(policy.unused_parameter_names()))
    assert unused > 789_970_944  # both language heads and the last VLM layer's output side
    replicated = _plan(_cfg("no"), 8, 1, policy)
    assert replicated.busiest.gradients == (4_028_019_472 - unused) * 4
    assert plan.busiest.total / replicated.busiest.total <= 1 / 8 + 0.02


def test_plan_table_script_prints_the_docs_table() -> None:
    """`python scripts/plan_table.py` prints the full-size pi0 table docs/sharding.md shows, row for row."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plan_table.py")], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(printed) == 1 + 12
    documented = (REPO / "docs" / "sharding.md").read_text().splitlines()
    start = documented.index(printed[0])
    assert documented[start:start + 14] == [printed[0], "|" + "---|" * 9, *printed[1:]]
