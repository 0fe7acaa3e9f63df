"""Canary: the accelerate internals that lerobot_mg/distributed/accelerator.py relies on.

The factory reaches past accelerate's public API in a few places (the CPU rehearsal of FSDP2/HSDP, fp16 on the
CPU, the cross-rank inf agreement, sharding our own units before ``prepare``). When an accelerate upgrade
breaks one of them, a test here fails first, and its message says which factory function to fix.
tests/dist/test_layouts.py pins the multi-process side (the device mesh and its dim names, real shards).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType
from torch import nn

from lerobot_mg.distributed.accelerator import _enable_cpu_fp16, _rehearse_on_cpu
from tests.launch_utils import free_port

FACTORY = "lerobot_mg/distributed/accelerator.py"


def _reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; a test that builds an Accelerator must not leak one."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    _reset_accelerate()
    yield
    _reset_accelerate()


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch, fresh_accelerate: None) -> Iterator[None]:
    """The environment torchrun gives one rank of a one-process job: accelerate then starts a real gloo group.

    Every variable accelerate writes is set here first, so monkeypatch restores the original environment.
    """
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _AutocastProbe(nn.Linear):
    """Records the CPU autocast dtype its forward ran under (None when autocast was off)."""

    def __init__(self) -> None:
        super().__init__(4, 1)
        self.autocast_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        return super().forward(x)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fsdp_accelerator() -> Accelerator:
    """The same construction path as build_accelerator for a sharded layout, on a one-rank world."""
    _rehearse_on_cpu()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="no_wrap")
    return Accelerator(cpu=True, fsdp_plugin=plugin, parallelism_config=ParallelismConfig())


def test_cpu_launch_is_multi_cpu_before_the_relabel(world_of_one: None) -> None:
    state = PartialState(cpu=True)
    assert state.distributed_type == DistributedType.MULTI_CPU, (
        f"PartialState(cpu=True) under torchrun is now {state.distributed_type}, not MULTI_CPU: "
        f"_rehearse_on_cpu in {FACTORY} only relabels MULTI_CPU and would do nothing. Find what accelerate "
        "reports for a CPU gloo launch now and relabel that."
    )
    assert dist.is_initialized() and dist.get_backend() == "gloo", (
        f"PartialState(cpu=True) no longer starts the gloo process group; {FACTORY} assumes it does."
    )


def test_shared_state_relabel_makes_accelerate_build_fsdp2(world_of_one: None) -> None:
    _rehearse_on_cpu()
    assert "distributed_type" in PartialState._shared_state, (
        "PartialState._shared_state has no 'distributed_type' entry: accelerate changed how it stores the "
        f"shared state; update _rehearse_on_cpu in {FACTORY}."
    )
    assert PartialState().distributed_type == DistributedType.MULTI_GPU, (
        "writing PartialState._shared_state['distributed_type'] no longer reaches new PartialState objects: "
        f"_rehearse_on_cpu in {FACTORY} must set the distributed type another way."
    )
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="no_wrap"),
        parallelism_config=ParallelismConfig(),
    )
    assert accelerator.distributed_type == DistributedType.FSDP, (
        f"with the MULTI_GPU relabel accelerate built {accelerator.distributed_type}, not FSDP: AcceleratorState "
        f"now chooses FSDP differently; rework _rehearse_on_cpu in {FACTORY} (CPU rehearsal of FSDP2/HSDP)."
    )
    assert accelerator.is_fsdp2 and accelerator.device.type == "cpu"


def test_prepare_wraps_only_the_root_around_units_sharded_before(world_of_one: None) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    accelerator = _fsdp_accelerator()
    model = _Toy()
    for block in model.blocks:
        fully_shard(block)
    prepared, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    units = sorted(name for name, module in prepared.named_modules() if isinstance(module, FSDPModule))
    assert prepared is model and units == ["", "blocks.0", "blocks.1"], (
        f"accelerate.prepare with auto_wrap_policy='no_wrap' now gives FSDP units {units} (expected the root "
        "around the two units sharded before it): prepare_units in "
        f"{FACTORY} relies on prepare leaving already-FSDPModule children alone and adding only the root."
    )


def test_ignored_modules_regex_maps_to_parameters() -> None:
    from accelerate.utils.fsdp_utils import get_parameters_from_modules

    model = _Toy()
    params = get_parameters_from_modules(r"head", model, torch.device("cpu"))
    assert params == {model.head.weight, model.head.bias}, (
        "accelerate.utils.fsdp_utils.get_parameters_from_modules no longer maps a module-path regex "
        f"(full match) to that module's parameters; prepare_units in {FACTORY} passes "
        "accelerator.fsdp.ignored_modules through it."
    )


def test_fsdp_dim_names_name_the_sharding_mesh() -> None:
    fsdp = ParallelismConfig(dp_replicate_size=1, dp_shard_size=2)
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    assert (fsdp.fsdp_dim_names, hsdp.fsdp_dim_names) == (["dp_shard_cp"], ["dp_replicate", "dp_shard_cp"]), (
        f"ParallelismConfig.fsdp_dim_names changed ({fsdp.fsdp_dim_names}, {hsdp.fsdp_dim_names}): prepare_units in "
        f"{FACTORY} slices accelerator.torch_device_mesh with them to shard our units on the same mesh as the root."
    )
    assert isinstance(Accelerator.__dict__.get("torch_device_mesh"), property), (
        f"Accelerator.torch_device_mesh is gone; prepare_units in {FACTORY} reads the device mesh from it."
    )


def test_cpu_fp16_gets_autocast_and_a_loss_scaler_only_through_the_shim(fresh_accelerate: None) -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.scaler is None and not accelerator.native_amp, (
        "accelerate now enables fp16 on the CPU by itself: _enable_cpu_fp16 in "
        f"{FACTORY} leaves its scaler alone; check it is a plain torch.amp.GradScaler('cpu') (FSDP2 needs no "
        "sharded scaler) and drop the shim."
    )
    _enable_cpu_fp16(accelerator)
    torch.manual_seed(0)
    probe = _AutocastProbe()
    model, optimizer = accelerator.prepare(probe, torch.optim.SGD(probe.parameters(), lr=0.1))

    out = model(torch.ones(2, 4))
    assert probe.autocast_dtype == torch.float16, (
        "setting accelerator.native_amp=True before prepare no longer autocasts forward on the CPU (forward ran "
        f"under {probe.autocast_dtype}): _enable_cpu_fp16 in {FACTORY} must enable autocast another way."
    )

    scale = accelerator.scaler.get_scale()
    # d(loss)/d(bias) = 0.5: small enough that the scaled fp16 gradient (0.5 x 65536) does not overflow.
    accelerator.backward(0.25 * out.float().sum())
    assert torch.equal(model.bias.grad, torch.tensor([0.5 * scale])), (
        f"accelerator.backward did not scale the loss by accelerator.scaler ({model.bias.grad} != 0.5 x {scale}): "
        f"_enable_cpu_fp16 in {FACTORY} assumes backward reads accelerator.scaler."
    )

    # An overflow: the scaler must record it per device under the inner optimizer, skip the step and back off.
    model.weight.grad[0, 0] = float("inf")
    weight_before = model.weight.detach().clone()
    accelerator.unscale_gradients()
    inner = optimizer.optimizer
    state = accelerator.scaler._per_optimizer_states[id(inner)]
    found_inf = state["found_inf_per_device"]
    assert isinstance(found_inf, dict) and [float(t) for t in found_inf.values()] == [1.0], (
        "GradScaler._per_optimizer_states[id(optimizer)]['found_inf_per_device'] no longer holds one flag "
        f"tensor per device ({found_inf!r}): sync_found_inf in {FACTORY} all-reduces those flags so that every "
        "rank skips an overflowed step."
    )
    optimizer.step()
    assert torch.equal(model.weight.detach(), weight_before) and optimizer.step_was_skipped, (
        f"the scaler did not skip the step on an inf gradient through the prepared optimizer; {FACTORY} and "
        "lerobot_mg/step.py rely on that."
    )
    assert accelerator.scaler.get_scale() < scale, (
        "the loss scale did not back off after a skipped step: Stepper.step in lerobot_mg/step.py detects "
        "skips by the scale decreasing."
    )
