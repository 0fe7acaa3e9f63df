"""Joint layers as FSDP2 units on real ranks (gloo): FSDP-2 and HSDP 2x2.

This file runs itself as spawned ranks (``python test_joint_units.py <dp_replicate> <dp_shard> <out_dir>``, as
tests/dist/test_fsdp_options.py does). Each rank builds the real accelerator factory, shards the protocol's toy
policy (tests/joint_toy.py) with ``prepare_units`` and ``prepare``, and keeps an unsharded copy of the same
initial weights as the one-process reference. One launch per layout checks:

- every joint layer's VLM and expert parameters are gathered together when the layer computes (both unsharded
  inside the nested expert call and after it returns) and resharded once the outer layer has finished, in the
  training pass, in the prefix-only pass that fills the KV cache and in each suffix (denoising) pass;
- state-dict names are those of the unsharded policy; the full state dict gathered on rank 0 and a DCP
  save/load round trip give back the same tensors;
- the training loss and every gradient equal the one-process reference's (tests/tolerances.py), also with every
  VLM layer checkpointed (the nested expert layer is recomputed); the frozen unused parameters get no gradient and
  their own units are never gathered; the action chunk of ``predict_action_chunk`` equals the reference's;
- gradient accumulation (2 micro-batches) keeps each rank's gradients sharded during the window and trains like
  one bigger batch.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lerobot_mg.checkpoint.dcp_io import load_dcp, save_dcp
from lerobot_mg.config.schema import AcceleratorConfig, GradientAccumulationConfig, TrainConfig
from lerobot_mg.distributed.accelerator import build_accelerator, launch_world, prepare, prepare_units
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.step import Stepper
from tests.joint_toy import ToyJointPolicy, toy_batch
from tests.launch_utils import PYTHON, REPO, clean_env, spawn_ranks
from tests.tolerances import FIRST_UPDATE_RTOL, assert_same_weights

GLOBAL_BATCH = 8
LR = 1e-3
WINDOWS = 2  # optimizer updates of the accumulation check


def _identity(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return batch


def _local(batch: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    size = len(batch["noise"]) // parts
    return {key: value[index * size:(index + 1) * size] for key, value in batch.items()}


def _sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor)


class GatherWatch:
    """Records, for every call of joint layer ``i``'s two forwards, whether each layer's parameters were gathered
    (plain tensors) or sharded (DTensors): inside the nested expert call, right after it, and after the outer
    forward with FSDP's own post-forward hook done."""

    def __init__(self, policy: ToyJointPolicy) -> None:
        self.events: list[tuple[int, str, bool, bool]] = []  # (layer, when, vlm gathered, expert gathered)
        for i, (vlm, expert) in enumerate(zip(policy.vlm_layers, policy.expert_layers)):
            def state(vlm: nn.Module = vlm, expert: nn.Module = expert) -> tuple[bool, bool]:
                return (not any(_sharded(p) for p in vlm.parameters()),
                        not any(_sharded(p) for p in expert.parameters()))

            expert.register_forward_pre_hook(lambda m, a, i=i, state=state: self.events.append((i, "expert in", *state())))
            expert.register_forward_hook(lambda m, a, o, i=i, state=state: self.events.append((i, "expert out", *state())))
            vlm.register_forward_hook(lambda m, a, o, i=i, state=state: self.events.append((i, "vlm done", *state())))

    def take(self) -> list[tuple[int, str, bool, bool]]:
        events, self.events = self.events, []
        return events


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the state dict, whole (collective)."""
    return {name: (value.full_tensor() if _sharded(value) else value).detach().clone()
            for name, value in get_model_state_dict(model).items()}


def _grads(model: nn.Module) -> dict[str, list[float] | None]:
    """Every parameter's gradient, whole (collective), None where it has none."""
    out: dict[str, list[float] | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        out[name] = None if grad is None else (grad.full_tensor() if _sharded(grad) else grad).flatten().tolist()
    return out


def _held_gradient(model: nn.Module, trainable: list[torch.Tensor]) -> float:
    """Gradient elements this rank holds (its shards in ``.grad``, HSDP's reduce-scattered shards waiting for the
    replica all-reduce, and any full gradient FSDP2 keeps without syncing) over the trainable elements."""
    held = sum(p.grad.to_local().numel() for p in trainable if p.grad is not None)
    groups = {id(group): group for module in model.modules() if isinstance(module, FSDPModule)
              if (group := module._get_fsdp_state()._fsdp_param_group) is not None}
    for group in groups.values():
        if group._partial_reduce_output is not None:
            held += group._partial_reduce_output.numel()
        held += sum(p.unsharded_accumulated_grad.numel() for p in group.fsdp_params
                    if p.unsharded_accumulated_grad is not None)
    return held / sum(p.numel() for p in trainable)


def scenario(dp_replicate: int, dp_shard: int, out_dir: Path) -> dict[str, Any]:
    world_size, rank, local_rank = launch_world()
    acc_cfg = AcceleratorConfig(gradient_accumulation=GradientAccumulationConfig(steps=2))
    cfg = TrainConfig(accelerator=acc_cfg)
    dims = ParallelDims.resolve(dp_replicate, dp_shard, world_size, rank, local_rank)
    accelerator = build_accelerator(acc_cfg, dims)
    torch.manual_seed(0)
    policy = ToyJointPolicy()
    reference = copy.deepcopy(policy)
    reference.freeze_unused_parameters()
    keys_before = list(policy.state_dict())
    prepare_units(accelerator, policy, acc_cfg, dims)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LR)
    model, optimizer = prepare(accelerator, policy, optimizer, dims)
    # Built as train() builds it, before any forward: it tells FSDP's parameters from ignored ones by their type.
    stepper = Stepper(accelerator, model, optimizer, None, _identity, cfg.optimizer.grad_clip_norm, dims)
    result: dict[str, Any] = {"keys_same": list(model.state_dict()) == keys_before}
    dp_rank, dp_world = rank, dims.dp_world_size  # every rank is a data-parallel rank of its own here
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        expected = reference.state_dict()
        result["full_state_equal"] = list(full) == list(expected) and all(
            torch.equal(full[name], expected[name]) for name in expected)
    dcp_dir = out_dir / "dcp"
    save_dcp({"model": get_model_state_dict(model)}, dcp_dir)
    torch.manual_seed(1)
    other = ToyJointPolicy()  # other weights, sharded the same way, then loaded from the DCP checkpoint
    prepare_units(accelerator, other, acc_cfg, dims)
    state = {"model": get_model_state_dict(other)}
    load_dcp(state, dcp_dir)
    set_model_state_dict(other, state["model"])
    reloaded, saved = _full(other), _full(model)
    result["dcp_round_trip_equal"] = all(torch.equal(reloaded[name], saved[name]) for name in saved)
    del other, state, reloaded

    watch = GatherWatch(policy)
    heads = [policy.model.paligemma_with_expert.paligemma.lm_head, policy.model.paligemma_with_expert.gemma_expert.lm_head]
    gathered_heads: list[str] = []
    for head in heads:  # never called, so never gathered (FSDPModule.unshard is what a pre-forward calls)
        group = head._get_fsdp_state()._fsdp_param_group
        group.unshard = lambda *args, original=group.unshard, **kwargs: (gathered_heads.append("lm_head"),
                                                                          original(*args, **kwargs))[1]
    batch = toy_batch(7, GLOBAL_BATCH)
    mine = _local(batch, dp_rank, dp_world)
    # Training: both streams in one pass, this rank's share of the global batch.
    loss, _ = model(mine)
    loss.backward()
    result["train_events"] = watch.take()
    result["loss"] = float(loss)
    expected_loss, _ = reference(mine)
    result["expected_loss"] = float(expected_loss)
    reference(batch)[0].backward()  # equal shares: the mean of the ranks' means is the global mean
    grads = _grads(model)
    # Entries whose exact gradient is zero (SigLIP's key bias: softmax ignores it) differ by rounding noise only: the
    # absolute floor is the relative tolerance of the largest gradient entry.
    floor = FIRST_UPDATE_RTOL * max(float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None)
    result["grad_problems"] = []
    for name, param in reference.named_parameters():
        got, want = grads[name], param.grad
        if want is None:
            if got is not None and any(got):
                result["grad_problems"].append(f"{name}: a gradient where the reference has none")
            continue
        got_t = torch.tensor(got).view_as(want)
        bound = FIRST_UPDATE_RTOL * want.abs() + floor
        if not bool(((got_t - want).abs() <= bound).all()):
            result["grad_problems"].append(f"{name}: max diff {(got_t - want).abs().max():.3g}")
    result["frozen_grads"] = {name: grads[name] for name in reference.unused_parameter_names()}

    # The same pass with every VLM layer checkpointed (the nested expert layer recomputed with it), sharded.
    torch.manual_seed(0)
    checkpointed = ToyJointPolicy()
    prepare_units(accelerator, checkpointed, AcceleratorConfig(activation_checkpointing=True), dims)
    fully_shard(checkpointed, mesh=accelerator.torch_device_mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)])
    expert_calls: list[int] = []
    checkpointed.expert_layers[0].register_forward_pre_hook(lambda module, args: expert_calls.append(0))
    checkpointed(mine)[0].backward()
    result["checkpointed_expert_calls"] = len(expert_calls)
    checkpointed_grads = _grads(checkpointed)
    result["checkpointed_grad_problems"] = [
        name for name, param in reference.named_parameters() if param.grad is not None
        and not torch.allclose(torch.tensor(checkpointed_grads[name]).view_as(param.grad), param.grad,
                               rtol=FIRST_UPDATE_RTOL, atol=floor)]
    del checkpointed
    optimizer.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)

    # Inference: the prefix-only pass, then num_steps suffix passes with the cached prefix.
    model.eval()
    reference.eval()
    with torch.no_grad():
        chunk = model.predict_action_chunk(mine)
        expected_chunk = reference.predict_action_chunk(mine)
    result["infer_events"] = watch.take()
    result["chunk_max_diff"] = float((chunk - expected_chunk).abs().max())
    model.train()
    reference.train()

    # Accumulation: 2 micro-batches per update on every rank against one process on the whole global batch.
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    trainable = [p for p in model.parameters() if p.requires_grad]
    result["window_grad_fraction"] = []
    for window in range(WINDOWS):
        batch = toy_batch(100 + window, GLOBAL_BATCH)
        mine = _local(batch, dp_rank, dp_world)
        for micro in range(2):
            logs = stepper.step(_local(mine, micro, 2))
            if not logs.synced:  # inside the window: what this rank holds of the gradients
                result["window_grad_fraction"].append(_held_gradient(model, trainable))
        reference(batch)[0].backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.optimizer.grad_clip_norm)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
    trained, expected = _full(model), reference.state_dict()
    if rank == 0:
        expected_trained = {name: expected[name] for name in trained}
        result["weight_problems"] = assert_free(trained, expected_trained)
    watch.take()
    result["gathered_heads"] = gathered_heads
    return result


def assert_free(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    try:
        assert_same_weights(actual, expected, WINDOWS, LR)
    except AssertionError as error:
        return str(error).splitlines()
    return []


def _main(dp_replicate: int, dp_shard: int, out_dir: str) -> None:
    result = scenario(dp_replicate, dp_shard, Path(out_dir))
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    gc.collect()
    torch.distributed.destroy_process_group()


# --- the tests ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[(1, 2), (2, 2)], ids=["fsdp2", "hsdp2x2"])
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    dp_replicate, dp_shard = request.param
    nproc = dp_replicate * dp_shard
    out_dir = tmp_path_factory.mktemp("joint") / f"{dp_replicate}x{dp_shard}"
    out_dir.mkdir()
    proc = spawn_ranks([PYTHON, str(Path(__file__).resolve()), str(dp_replicate), str(dp_shard), str(out_dir)],
                       nproc, clean_env({"PYTHONPATH": str(REPO)}), REPO, 300)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(nproc)]


pytestmark = pytest.mark.dist


def _expected_events(passes: list[tuple[str, int]]) -> list[list[Any]]:
    """Both layers gathered inside and right after the nested call, both sharded after the outer forward, layer by
    layer, for each pass."""
    events = []
    for _, num_layers in passes:
        for i in range(num_layers):
            events += [[i, "expert in", True, True], [i, "expert out", True, True], [i, "vlm done", False, False]]
    return events


def test_a_joint_layer_gathers_both_stacks_together_and_reshards_after(layout: list[dict[str, Any]]) -> None:
    for result in layout:
        assert result["train_events"] == _expected_events([("train", 2)])
        # predict_action_chunk: the prefix-only pass, then one suffix pass per denoising step (2).
        assert result["infer_events"] == _expected_events([("prefix", 2), ("suffix", 2), ("suffix", 2)])


def test_state_dict_names_and_values_survive_the_grouping(layout: list[dict[str, Any]]) -> None:
    assert all(result["keys_same"] and result["dcp_round_trip_equal"] for result in layout)
    assert layout[0]["full_state_equal"]


def test_loss_gradients_and_actions_equal_one_process(layout: list[dict[str, Any]]) -> None:
    for result in layout:
        assert abs(result["loss"] - result["expected_loss"]) <= FIRST_UPDATE_RTOL * abs(result["expected_loss"])
        assert result["grad_problems"] == []
        assert all(grad is None for grad in result["frozen_grads"].values()), result["frozen_grads"]
        assert result["gathered_heads"] == []  # the unused heads' own units: sharded throughout
        assert result["chunk_max_diff"] <= 1e-5


def test_a_checkpointed_joint_layer_recomputes_the_expert_and_gives_the_same_gradients(
        layout: list[dict[str, Any]]) -> None:
    for result in layout:
        assert result["checkpointed_expert_calls"] == 2  # the forward, then the recomputation in backward
        assert result["checkpointed_grad_problems"] == []


def test_accumulation_keeps_gradients_sharded_and_trains_like_the_bigger_batch(layout: list[dict[str, Any]]) -> None:
    for result in layout:
        # One micro-batch into each window: at most 1/dp_shard of the trainable elements (torch.chunk rounds up a
        # little; the last VLM layer's unread outputs give its o_proj and MLP no gradient at all). Under no_sync
        # every rank would hold the full gradient of every parameter that gets one: dp_shard times as much.
        assert len(result["window_grad_fraction"]) == WINDOWS
        assert all(0 < fraction <= 1 / 2 + 0.02 for fraction in result["window_grad_fraction"]), result
    assert layout[0]["weight_problems"] == []


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
