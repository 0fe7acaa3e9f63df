"""accelerator.activation_checkpointing and accelerator.compile in one process: what they apply to, that
checkpointing keeps the gradients and drops the stored activations, that compile trains like eager, and the
start-up errors where either cannot work. (Their composition with DDP, FSDP2 and HSDP: tests/dist.)"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lerobot_mg.config.schema import AcceleratorConfig, FSDPConfig, TrainConfig
from lerobot_mg.distributed.accelerator import build_accelerator, prepare_units
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.distributed.wrap import plan_units
from lerobot_mg.errors import ConfigError
from lerobot_mg.optim import make_optimizer
from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.policies.base import checkpoint_activations
from lerobot_mg.policies.diffusion import DiffusionPolicy
from lerobot_mg.preflight import preflight
from lerobot_mg.step import Stepper
from tests.dist.test_fsdp_options import ToyPolicy
from tests.unit.test_diffusion import IMAGE_INPUTS, OUTPUTS, STATE_ONLY_INPUTS, make_batch, tiny_config
from tests.unit.test_wrap import Undeclared

ACT_INPUTS = {"observation.state": {"type": "STATE", "shape": [3]}}


def _act(dropout: float = 0.0) -> ACTPolicy:
    config = ACTConfig(chunk_size=HORIZON_ACT, n_action_steps=HORIZON_ACT, dim_model=16, n_heads=2,
                       dim_feedforward=32, n_encoder_layers=2, n_vae_encoder_layers=1, dropout=dropout)
    return ACTPolicy(config, ACT_INPUTS, OUTPUTS)


HORIZON_ACT = 4


def _act_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"observation.state": torch.randn(3, 3, generator=generator),
            "action": torch.randn(3, HORIZON_ACT, 2, generator=generator),
            "action_is_pad": torch.zeros(3, HORIZON_ACT, dtype=torch.bool)}


def _names(modules: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in modules]


# --- what the switches apply to --------------------------------------------------------------------------


def test_checkpointing_takes_the_declared_blocks_and_compile_the_units() -> None:
    on = AcceleratorConfig(activation_checkpointing=True, compile=True)
    act_plan = plan_units(_act(), on, sharded=False)
    layers = ["model.vae_encoder.layers.0", "model.encoder.layers.0", "model.encoder.layers.1",
              "model.decoder.layers.0"]
    assert _names(act_plan.units) == layers  # ACT's declared wrap units, also without sharding
    assert sorted(_names(act_plan.checkpointed)) == sorted(_names(act_plan.compiled)) == sorted(layers)

    # Diffusion declares no wrap units but its checkpoint blocks: every residual block (and image block).
    diffusion = DiffusionPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS)
    plan = plan_units(diffusion, on, sharded=False)
    assert plan.units == []
    checkpointed = {type(module).__name__ for _, module in plan.checkpointed}
    assert checkpointed == {"DiffusionConditionalResidualBlock1d", "BasicBlock"} and len(plan.checkpointed) == 8 + 2
    # No units: the whole network, not the loss code (the `diffusion` container has no forward: its children).
    assert _names(plan.compiled) == ["diffusion.rgb_encoder.0", "diffusion.unet"]

    # Sharded by size: the size units carry compile (outermost only); checkpointing keeps the declared blocks.
    by_size = AcceleratorConfig(activation_checkpointing=True, compile=True, fsdp=FSDPConfig(min_num_params=5000))
    sharded = plan_units(DiffusionPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS), by_size, sharded=True)
    assert "diffusion.unet" in _names(sharded.units) and _names(sharded.compiled) == ["diffusion.unet"]
    assert {type(m).__name__ for _, m in sharded.checkpointed} == {"DiffusionConditionalResidualBlock1d"}


def test_checkpointing_without_blocks_or_units_stops_with_the_thresholds_to_use() -> None:
    with pytest.raises(ConfigError) as error:
        plan_units(Undeclared(), AcceleratorConfig(activation_checkpointing=True), sharded=False)
    assert str(error.value).startswith(
        "accelerator.fsdp.wrap_modules=None and accelerator.fsdp.min_num_params=None: Undeclared declares no "
        "_fsdp_wrap_modules or _checkpoint_modules, so accelerator.activation_checkpointing=true has no block to "
        "recompute. Fix: accelerator.fsdp.min_num_params=38 gives 4 units"
    )
    # The suggested fix, on the same unsharded run: the four Linear units are checkpointed.
    fixed = AcceleratorConfig(activation_checkpointing=True, fsdp=FSDPConfig(min_num_params=38))
    assert len(plan_units(Undeclared(), fixed, sharded=False).checkpointed) == 4
    # Compile alone has no such need: the top-level modules, and only a model without any stops. A container
    # without a forward (the toy's encoder and blocks) is never called: what it holds is compiled instead.
    assert _names(plan_units(Undeclared(), AcceleratorConfig(compile=True), sharded=False).compiled) == [
        *(f"encoder.blocks.{index}.linear" for index in range(4)), "head"
    ]
    with pytest.raises(ConfigError, match=r"accelerator.compile=True: Bare has no wrap unit and no submodule"):
        plan_units(type("Bare", (nn.Module,), {})(), AcceleratorConfig(compile=True), sharded=False)


def test_compile_without_a_compiler_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.launch_utils import PUSHT_SLICE

    monkeypatch.setenv("PATH", "/nonexistent")
    cfg = TrainConfig(policy=ACTConfig(), accelerator=AcceleratorConfig(compile=True, cpu=True))
    cfg.dataset.root = str(PUSHT_SLICE)
    with pytest.raises(ConfigError) as error:
        preflight(cfg, world_size=1)
    assert str(error.value) == (
        "accelerator.compile=True: torch.compile's CPU backend (inductor) needs a C++ compiler, and 'g++' is not on "
        "PATH. Fix: accelerator.compile=false"
    )


# --- activation checkpointing: same gradients, fewer stored activations ----------------------------------


class SavedBytes:
    """Bytes autograd keeps for backward outside checkpointed regions (inside one, checkpoint's own hooks
    keep nothing but the region's inputs)."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.num_bytes += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _gradients(policy: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    saved = SavedBytes()
    torch.manual_seed(1)  # ACT's dropout: the same masks with and without recomputation
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        loss, _ = policy(batch)
    loss.backward()
    return {name: param.grad.clone() for name, param in policy.named_parameters()}, saved.num_bytes


@pytest.mark.parametrize("policy_name", ["act", "diffusion"])
def test_checkpointing_keeps_the_gradients_and_drops_the_activations(policy_name: str) -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        if policy_name == "act":
            return _act(dropout=0.1).train()
        return DiffusionPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS).train()

    batch = _act_batch() if policy_name == "act" else make_batch(IMAGE_INPUTS)
    expected, stored = _gradients(build(), batch)
    policy = build()
    for _, block in plan_units(policy, AcceleratorConfig(activation_checkpointing=True), sharded=False).checkpointed:
        checkpoint_activations(block)
    got, stored_with_checkpointing = _gradients(policy, batch)
    for name, grad in expected.items():  # recomputation replays the same ops on the same inputs: bit-identical
        assert torch.equal(got[name], grad), name
    assert stored_with_checkpointing < 0.5 * stored, (stored_with_checkpointing, stored)
    # Parameter names (hence checkpoints) are untouched.
    assert [name for name, _ in policy.named_parameters()] == list(expected)


# --- compile: trains like eager ---------------------------------------------------------------------------


@pytest.fixture
def single_process() -> Iterator[ParallelDims]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield ParallelDims.resolve(1, 1, 1)
    for state in (AcceleratorState, GradientState, PartialState):
        state._reset_state()


def _losses(compile_units: bool, dims: ParallelDims, num_steps: int) -> list[float]:
    """Losses of ``num_steps`` real loop steps (accelerator factory, prepare_units, Stepper) of the toy policy
    (two residual tanh blocks as wrap units: the cheapest honest compile; a U-Net takes minutes on a CPU)."""
    acc_cfg = AcceleratorConfig(compile=compile_units, cpu=True)
    cfg = TrainConfig(policy=ACTConfig(), accelerator=acc_cfg)
    accelerator = build_accelerator(acc_cfg, dims)
    torch.manual_seed(0)
    policy = ToyPolicy()
    units = [name for name, _ in plan_units(policy, acc_cfg, dims.is_sharded).units]
    prepare_units(accelerator, policy, acc_cfg, dims)
    compiled = [name for name, module in policy.named_modules() if hasattr(module.forward, "_torchdynamo_orig_callable")]
    assert units == compiled == (["blocks.0", "blocks.1"] if compile_units else [])
    optimizer = make_optimizer(policy, cfg.optimizer)
    model, optimizer = accelerator.prepare(policy, optimizer)
    stepper = Stepper(accelerator, model, optimizer, None, lambda batch: batch, cfg.optimizer.grad_clip_norm, dims)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(num_steps):
        batch = {"observation.state": torch.randn(8, 4, generator=generator),
                 "action": torch.randn(8, 2, generator=generator)}
        losses.append(float(stepper.step(batch).losses["loss"]))  # StepLogs holds device tensors
    return losses


def test_compiled_units_train_like_eager(single_process: ParallelDims) -> None:
    """20 loop steps, compiled (inductor, the C++ backend on a CPU) against eager: the same losses up to float
    reassociation, while the loss itself moves by far more."""
    eager = _losses(False, single_process, 20)
    compiled = _losses(True, single_process, 20)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert statistics.pstdev(eager) > 1e-2
