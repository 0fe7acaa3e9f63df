"""Fault drills stay out of a normal run's step: the plain Stepper holds no drill code, and only the rank that
``LEROBOT_MG_FAULT`` names gets the stepper that runs one, acting after its drill step's backward and before that
step's optimizer update. The drills on real process groups are in tests/dist/test_faults.py."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.drills import FAULT_ENV, DrillStepper, FaultDrillError, stepper_type
from lerobot_mg.step import Stepper
from tests.unit.test_lr_schedule import Regression


def _stepper(rank: int) -> tuple[Stepper, nn.Module]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = Regression()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stepper = stepper_type(rank)(accelerator, model, optimizer, None, lambda batch: batch, 0.0,
                                 ParallelDims.resolve(1, 1, 1, 0, 0))
    return stepper, model


def _batch() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 3), "y": torch.randn(4, 1)}


def test_without_the_variable_every_rank_gets_the_plain_stepper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert stepper_type(0) is Stepper and stepper_type(1) is Stepper
    monkeypatch.setenv(FAULT_ENV, "raise@rank1:step2")
    assert stepper_type(0) is Stepper  # another rank's drill
    stepper, model = _stepper(0)
    before = model.linear.weight.detach().clone()
    for _ in range(3):
        assert stepper.step(_batch()).synced
    assert not torch.equal(model.linear.weight, before)  # it trained


def test_the_named_rank_acts_after_backward_before_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "raise@rank1:step2")
    stepper, model = _stepper(1)
    assert isinstance(stepper, DrillStepper)
    stepper.step(_batch())
    after_one_update = model.linear.weight.detach().clone()
    with pytest.raises(FaultDrillError, match="injected failure on rank 1 at loop step 2"):
        stepper.step(_batch())
    assert model.linear.weight.grad is not None  # step 2's backward ran ...
    assert torch.equal(model.linear.weight, after_one_update)  # ... and its update did not


def test_a_misspelt_drill_is_refused_rather_than_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "explode@rank1:step2")
    with pytest.raises(RuntimeError, match=f"{FAULT_ENV}='explode@rank1:step2': expected <kill|raise"):
        stepper_type(0)
