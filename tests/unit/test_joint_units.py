"""Joint layers as FSDP2 units, on one process: the policy's ``fsdp_unit_groups()`` become grouped units beside the
class-name units, what the plan says about them, the tie check, frozen unused parameters, and activation
checkpointing of the outer (VLM) layer recomputing the nested expert layer. The sharded behaviour (gathered
together, resharded after, numbers equal to one process) is in tests/dist/test_joint_units_ranks.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.distributed.accelerator import accumulation_plugin
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.distributed.wrap import (
    declared_groups,
    find_split_ties,
    freeze_unused,
    plan_units,
)
from lerobot_mg.policies.base import checkpoint_activations
from tests.joint_toy import Sizes, ToyJointPolicy, toy_batch

VLM = "model.paligemma_with_expert.paligemma.model.language_model.layers"
EXPERT = "model.paligemma_with_expert.gemma_expert.model.layers"


def test_each_joint_layer_is_one_unit_beside_the_vision_layers() -> None:
    policy = ToyJointPolicy(Sizes(num_layers=3))
    plan = plan_units(policy, AcceleratorConfig(), sharded=True)
    assert [group.names for group in plan.groups] == [(f"{VLM}.{i}", f"{EXPERT}.{i}") for i in range(3)]
    assert [name for name, _ in plan.units] == [
        "model.paligemma_with_expert.paligemma.model.vision_tower.layers.0",
        "model.paligemma_with_expert.paligemma.model.vision_tower.layers.1",
    ]
    # The language-model heads (declared unused) are units of their own, which no pass calls.
    assert [name for name, _ in plan.idle] == ["model.paligemma_with_expert.paligemma.lm_head",
                                               "model.paligemma_with_expert.gemma_expert.lm_head"]
    lines = plan.describe()
    assert lines[0] == (f"joint units: 3 ({VLM}.i + {EXPERT}.i), e.g. {VLM}.2 + {EXPERT}.2")
    assert lines[1].startswith("FSDP wrap units (ToyJointPolicy._fsdp_wrap_modules=['ToyVisionLayer']): 2 units")
    assert lines[2] == ("never gathered (unused parameters, in checkpoints only): 2 units, e.g. "
                        "model.paligemma_with_expert.gemma_expert.lm_head")


def test_joint_units_need_no_class_rule() -> None:
    """A policy that declares only its groups shards them (no accelerator.fsdp.* needed); one that declares
    nothing is still refused."""
    class GroupsOnly(ToyJointPolicy):
        _fsdp_wrap_modules = []

    plan = plan_units(GroupsOnly(), AcceleratorConfig(), sharded=True)
    assert len(plan.groups) == 2 and plan.units == []


def test_a_group_of_foreign_or_overlapping_modules_is_a_policy_bug() -> None:
    policy = ToyJointPolicy()
    policy.fsdp_unit_groups = lambda: [(policy.vlm_layers[0], nn.Linear(2, 2))]
    with pytest.raises(ValueError, match="not submodules of the model"):
        declared_groups(policy)
    policy.fsdp_unit_groups = lambda: [(policy.vlm_layers[0], policy.expert_layers[0]),
                                       (policy.vlm_layers[0].mlp, policy.expert_layers[1])]
    with pytest.raises(ValueError, match=r"layers\.0\.mlp overlaps .*layers\.0 of the group"):
        declared_groups(policy)


def test_a_weight_tied_inside_one_group_stays_and_one_tied_across_groups_is_named() -> None:
    policy = ToyJointPolicy()
    plan = plan_units(policy, AcceleratorConfig(), sharded=True)
    assert find_split_ties(policy, plan.units, plan.groups) == []
    vlm0, expert0, expert1 = policy.vlm_layers[0], policy.expert_layers[0], policy.expert_layers[1]
    expert0.self_attn.o_proj.weight = vlm0.self_attn.q_proj.weight  # (8, 16) both: inside joint layer 0
    assert find_split_ties(policy, plan.units, plan.groups) == []
    expert1.self_attn.o_proj.weight = vlm0.self_attn.q_proj.weight  # across joint layers 0 and 1
    (problem,) = find_split_ties(policy, plan.units, plan.groups)
    assert f"(unit {VLM}.1 + {EXPERT}.1)" in problem and f"(unit {VLM}.0 + {EXPERT}.0)" in problem


def test_unused_parameters_are_frozen_and_stay_in_the_state_dict() -> None:
    policy = ToyJointPolicy()
    keys = list(policy.state_dict())
    assert freeze_unused(policy) == policy.unused_parameter_names()
    assert list(policy.state_dict()) == keys
    frozen = {name for name, p in policy.named_parameters() if not p.requires_grad}
    assert frozen == set(policy.unused_parameter_names())
    loss, _ = policy(toy_batch(0))
    loss.backward()
    assert all(p.grad is None for name, p in policy.named_parameters() if name in frozen)


def test_checkpointing_the_vlm_layer_recomputes_the_nested_expert_layer_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    reference = ToyJointPolicy()
    policy = copy.deepcopy(reference)
    plan = plan_units(policy, AcceleratorConfig(activation_checkpointing=True), sharded=False)
    assert [name for name, _ in plan.checkpointed] == [f"{VLM}.0", f"{VLM}.1"]
    for _, block in plan.checkpointed:
        checkpoint_activations(block)
    calls = []
    policy.expert_layers[0].register_forward_pre_hook(lambda module, args: calls.append("expert 0"))
    batch = toy_batch(1)
    loss, _ = policy(batch)
    assert calls == ["expert 0"]
    loss.backward()
    assert calls == ["expert 0", "expert 0"]  # the nested call ran again in backward: recomputed
    expected, _ = reference(batch)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, param), (_, want) in zip(policy.named_parameters(), reference.named_parameters()):
        assert (param.grad is None) == (want.grad is None), name
        if want.grad is not None:
            torch.testing.assert_close(param.grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_sharded_accumulation_reduce_scatters_every_micro_batch_and_ddp_keeps_no_sync() -> None:
    """accelerate enters ``no_sync`` (full unsharded gradients on every rank under FSDP2) unless ``sync_each_batch``;
    a sharded layout sets it, DDP keeps its one all-reduce per window (tests/dist/test_joint_units_ranks.py measures what a
    rank holds inside the window)."""
    for (replicate, shard, world), sharded in (((2, 1, 2), False), ((1, 2, 2), True), ((2, 2, 4), True)):
        plugin = accumulation_plugin(4, ParallelDims.resolve(replicate, shard, world, launched=True))
        assert plugin.num_steps == 4 and plugin.sync_each_batch is sharded
