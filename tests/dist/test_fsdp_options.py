"""The FSDP options of the guide on real 2-rank gloo launches.

Two kinds of launch:

* ``scripts/train.py`` through ``tests.launch_utils.run_train`` for what a user runs end to end;
* this file itself as 2 spawned ranks (``tests.launch_utils.spawn_ranks``: ``python test_fsdp_options.py
  <scenario> <out_dir>`` with torchrun's variables) for checks that must look inside the processes. A scenario
  builds the real accelerator factory, shards a toy policy with ``prepare_units``, steps it with the real
  ``Stepper`` and writes one json per rank that the tests assert on. One launch serves several tests
  (module-scoped fixtures) because a start costs seconds.

Finding on the installed torch (2.13), asserted by
``test_mixed_precision_policy_is_built_from_its_fields_alone``: with
``MixedPrecisionPolicy(param_dtype=bfloat16)`` and ``reduce_dtype`` unset, FSDP2 reduce-scatters the gradients
in **bfloat16**: ``FSDPParam.init_dtype_attrs`` keeps ``reduce_dtype=None`` and ``foreach_reduce`` then
reduces in the gradients' own dtype, which is the compute dtype ``param_dtype``. The reduced shards are cast
back to the float32 of the sharded parameters afterwards. Set ``reduce_dtype=float32`` to reduce in full
precision (also asserted below).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.distributed.tensor import DTensor

from lerobot_mg.config.schema import AcceleratorConfig, FSDPConfig, MixedPrecisionPolicyConfig, TrainConfig
from lerobot_mg.distributed.accelerator import (
    _mixed_precision_policy,
    build_accelerator,
    launch_world,
    prepare_units,
)
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.distributed.wrap import plan_units
from lerobot_mg.step import Stepper
from tests.dist.conftest import DETERMINISTIC_RUN, LAYOUT_RUNS
from tests.launch_utils import PYTHON, REPO, clean_env, interval_metrics, last_weights, run_train, spawn_ranks
from tests.tolerances import assert_same_series, assert_same_weights

if TYPE_CHECKING:
    from tests.dist.conftest import Run

WIDTH = 8
NUM_SYNCED_STEPS = 3
NUM_UNSYNCED_STEPS = 2
MAX_FP16_WARMUP_STEPS = 12


# --- toy policies (shared by the scenarios) -----------------------------------------------------------------


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x_BW: torch.Tensor) -> torch.Tensor:
        return x_BW + torch.tanh(self.linear(x_BW))


class ToyPolicy(nn.Module):
    """The policy contract in miniature: ``forward(batch) -> (loss, logs)`` and declared wrap units."""

    _fsdp_wrap_modules: ClassVar[list[str]] = ["ToyBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x_BW = self.encoder(batch["observation.state"])
        for block in self.blocks:
            x_BW = block(x_BW)
        # Both in float32: FSDP2 casts the batch to param_dtype, and torch 2.11's mse_loss backward fails on a
        # float32 input with a bfloat16 target (2.13 promotes the target, to the same numbers).
        loss = F.mse_loss(self.head(x_BW).float(), batch["action"].float())
        return loss, {"mse": loss.detach()}


class TiedToyPolicy(ToyPolicy):
    """An output layer tied to the last block's weight: the tie crosses from a wrap unit into the root."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, WIDTH, bias=False)
        self.head.weight = self.blocks[-1].linear.weight


class UndeclaredToyPolicy(ToyPolicy):
    _fsdp_wrap_modules: ClassVar[list[str]] = []


def _toy_batch(step: int, rank: int, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """Each rank's own micro-batch: different data on every rank, reproducible from (step, rank)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "observation.state": torch.randn(batch_size, 4, generator=generator),
        "action": torch.randn(batch_size, 2, generator=generator),
    }


# --- the scenarios (run on every rank) ----------------------------------------------------------------------


def _setup(
    mixed_precision: str, dp_shard: int, fsdp: FSDPConfig | None = None
) -> tuple[Accelerator, ParallelDims, TrainConfig]:
    """(accelerator, dims, cfg) from the real factory. Collective."""
    world_size, rank, local_rank = launch_world()
    cfg = TrainConfig(
        accelerator=AcceleratorConfig(mixed_precision=mixed_precision, fsdp=fsdp or FSDPConfig())
    )
    dims = ParallelDims.resolve(1, dp_shard, world_size, rank, local_rank)
    return build_accelerator(cfg.accelerator, dims), dims, cfg


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full, as float32. Collective under FSDP (gathers the shards)."""
    full = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        full[name.removeprefix("module.")] = tensor.detach().float().clone()
    return full


def _identity(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return batch


class ReduceDtypeRecorder(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, noting the dtype of every gradient buffer it reduces."""

    def __init__(self) -> None:
        self.dtypes: list[str] = []

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        self.dtypes.append(str(input_tensor.dtype))
        return super().__call__(output_tensor, input_tensor, *args, **kwargs)


def scenario_wrap_checks_and_reduce_dtype() -> dict[str, Any]:
    """Tied weights and an undeclared policy refused by ``prepare_units``; then one bf16 step with a
    ``param_dtype``-only policy, recording the dtype FSDP2 reduces gradients in."""
    fsdp = FSDPConfig(mixed_precision_policy=MixedPrecisionPolicyConfig(param_dtype="bfloat16"))
    accelerator, dims, cfg = _setup("bf16", 2, fsdp)
    result: dict[str, Any] = {}
    for name, refused in (("tied", TiedToyPolicy()), ("undeclared", UndeclaredToyPolicy())):
        try:
            prepare_units(accelerator, refused, cfg.accelerator, dims)
            result[f"{name}_error"] = None
        except ValueError as error:
            result[f"{name}_error"] = str(error)

    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    result["plugin_policy"] = {
        field: str(getattr(policy, field))
        for field in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    }
    torch.manual_seed(0)
    model = ToyPolicy()
    recorder = ReduceDtypeRecorder()
    units = [name for name, _ in plan_units(model, cfg.accelerator, dims.is_sharded).units]
    prepare_units(accelerator, model, cfg.accelerator, dims)
    for unit in units:
        model.get_submodule(unit).set_custom_reduce_scatter(recorder)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.set_custom_reduce_scatter(recorder)  # the root unit accelerate wrapped
    stepper = Stepper(accelerator, model, optimizer, None, _identity, cfg.optimizer.grad_clip_norm, dims)
    logs = stepper.step(_toy_batch(0, dims.rank))
    result.update(
        units=units,
        loss=float(logs.losses["loss"]),  # StepLogs holds device tensors
        reduce_dtypes_unset=recorder.dtypes,
        sharded_param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
    )

    # The contrast: the same unit with reduce_dtype set explicitly reduces in float32.
    explicit_recorder = ReduceDtypeRecorder()
    torch.manual_seed(0)
    block = ToyBlock()
    mesh = accelerator.torch_device_mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    fully_shard(
        block,
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    block.set_custom_reduce_scatter(explicit_recorder)
    block(torch.randn(2, WIDTH)).float().pow(2).mean().backward()
    result["reduce_dtypes_explicit_float32"] = explicit_recorder.dtypes
    return result


def scenario_ignored_modules() -> dict[str, Any]:
    """``accelerator.fsdp.ignored_modules`` on 2 ranks with different data, against one process that trains on
    both ranks' data; then more steps with ``sync_ignored_grads`` switched off."""
    # reshard_after_forward and cpu_offload ride along: they must not change the numbers either.
    fsdp = FSDPConfig(
        ignored_modules=r"head|blocks\.0\.linear", reshard_after_forward=False, cpu_offload=True
    )
    accelerator, dims, cfg = _setup("no", 2, fsdp)
    torch.manual_seed(0)
    model = ToyPolicy()
    reference = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    prepare_units(accelerator, model, cfg.accelerator, dims)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = Stepper(accelerator, model, optimizer, None, _identity, cfg.optimizer.grad_clip_norm, dims)
    ignored_ids = {id(p) for p in stepper.ignored_params}
    ignored_names = [name for name, p in model.named_parameters() if id(p) in ignored_ids]
    sharded_names = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    param_group = model.blocks[1]._get_fsdp_state()._fsdp_param_group
    unit_options = {
        "reshards_after_forward": param_group.post_forward_mesh_info is not None,
        "offload_policy": repr(param_group.offload_policy),
    }

    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(NUM_SYNCED_STEPS):
        stepper.step(_toy_batch(step, dims.rank))
        global_batch = {
            key: torch.cat([_toy_batch(step, rank)[key] for rank in range(dims.world_size)])
            for key in ("observation.state", "action")
        }
        loss, _ = reference(global_batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.optimizer.grad_clip_norm)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    synced = _full_params(model)
    max_diff = max((synced[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters())

    with patch("lerobot_mg.step.sync_ignored_grads", lambda params, world_size: None):
        for step in range(NUM_SYNCED_STEPS, NUM_SYNCED_STEPS + NUM_UNSYNCED_STEPS):
            stepper.step(_toy_batch(step, dims.rank))
    unsynced = _full_params(model)
    return {
        "ignored_names": ignored_names,
        "sharded_names": sharded_names,
        "unit_options": unit_options,
        "max_abs_diff_vs_one_process": max_diff,
        "ignored_moved": min((synced[n] - initial[n]).abs().max().item() for n in ignored_names),
        "ignored_synced": {n: synced[n].flatten().tolist() for n in ignored_names},
        "ignored_unsynced": {n: unsynced[n].flatten().tolist() for n in ignored_names},
    }


@contextmanager
def _overflow_after_backward(accelerator: Accelerator, model: nn.Module) -> Iterator[None]:
    """An inf in this rank's own gradient right after backward (its shard under FSDP, its already all-reduced
    copy under DDP): an overflow that only this rank can see when the scaler unscales."""
    original = accelerator.backward

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        original(loss, **kwargs)
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.view(-1)[0] = float("inf")

    accelerator.backward = backward
    try:
        yield
    finally:
        del accelerator.backward  # back to the class's method


def _fp16_overflow(dp_shard: int) -> dict[str, Any]:
    """fp16 steps: clean ones until the loss scaler has backed off far enough that one is not skipped, then an
    overflow on rank 1 only, then the same with ``sync_found_inf`` switched off."""
    accelerator, dims, cfg = _setup("fp16", dp_shard)
    torch.manual_seed(0)
    model = ToyPolicy()
    prepare_units(accelerator, model, cfg.accelerator, dims)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = Stepper(accelerator, model, optimizer, None, _identity, cfg.optimizer.grad_clip_norm, dims)
    result: dict[str, Any] = {
        "distributed_type": str(accelerator.distributed_type),
        "scaler": f"{type(accelerator.scaler).__name__}({accelerator.scaler._device})",
        "initial_scale": accelerator.scaler.get_scale(),
        "steps": [],
    }

    def run(step: int, overflow_rank: int | None, found_inf_sync: Callable | None = None) -> bool:
        before = _full_params(model)
        inject = _overflow_after_backward(accelerator, model) if dims.rank == overflow_rank else nullcontext()
        keep_sync = (
            nullcontext()
            if found_inf_sync is None
            else patch("lerobot_mg.step.sync_found_inf", found_inf_sync)
        )
        with inject, keep_sync:
            logs = stepper.step(_toy_batch(step, dims.rank))
        after = _full_params(model)
        result["steps"].append(
            {
                "synced": logs.synced,
                "skipped": bool(logs.skipped),  # StepLogs holds device tensors
                "weights_changed": any(not torch.equal(before[name], after[name]) for name in before),
                "scale": accelerator.scaler.get_scale(),
                "loss": float(logs.losses["loss"]),
            }
        )
        return bool(logs.skipped)

    # The default initial scale (2**16) overflows these fp16 gradients: real runs skip their first steps too.
    step = 0
    while run(step, overflow_rank=None) and step < MAX_FP16_WARMUP_STEPS:
        step += 1
    run(step + 1, overflow_rank=1)
    run(step + 2, overflow_rank=1, found_inf_sync=lambda accelerator, optimizer: None)
    return result


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "wrap_checks_and_reduce_dtype": scenario_wrap_checks_and_reduce_dtype,
    "ignored_modules": scenario_ignored_modules,
    "fp16_overflow_ddp": lambda: _fp16_overflow(dp_shard=1),
    "fp16_overflow_fsdp": lambda: _fp16_overflow(dp_shard=2),
}


def _scenario_main(name: str, out_dir: str) -> None:
    result = SCENARIOS[name]()
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    gc.collect()  # the scenario's models before their process groups (lerobot_mg/launch/run_state.py says why)
    torch.distributed.destroy_process_group()


# --- the tests ----------------------------------------------------------------------------------------------


def _run_scenario(name: str, out_dir: Path, timeout: float = 180) -> list[dict[str, Any]]:
    """Launch this file as 2 ranks; the per-rank results. A hang fails after ``timeout``."""
    out_dir.mkdir(parents=True)
    proc = spawn_ranks([PYTHON, str(Path(__file__).resolve()), name, str(out_dir)], 2,
                       clean_env({"PYTHONPATH": str(REPO)}), REPO, timeout)
    assert proc.returncode == 0, f"scenario {name} exited {proc.returncode}\n{proc.stdout[-8000:]}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def wrap_checks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run_scenario("wrap_checks_and_reduce_dtype", tmp_path_factory.mktemp("fsdp") / "wrap_checks")


@pytest.fixture(scope="module")
def ignored(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run_scenario("ignored_modules", tmp_path_factory.mktemp("fsdp") / "ignored")


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def fp16_overflow(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return _run_scenario(f"fp16_overflow_{request.param}", tmp_path_factory.mktemp("fsdp") / request.param)


@pytest.mark.dist
def test_size_based_wrap_with_reshard_and_cpu_offload_trains_like_ddp(
    layout_run: Callable[[str], Run], tmp_path: Path
) -> None:
    """min_num_params on the real debug ACT: at 40000 each encoder layer (33472) stays below while their
    ModuleList (66944) passes, the case where accelerate's size policy crashes; the units become the ACTEncoder
    and the decoder layer (50240). With reshard_after_forward=false and cpu_offload=true on a host without a
    GPU: the same losses, gradient norms and weights as DDP-2 on the same data and seeds (the layout tests' run)."""
    nproc, ddp_overrides = LAYOUT_RUNS["ddp_b4"]
    fsdp = run_train(
        [
            *DETERMINISTIC_RUN,
            *ddp_overrides,
            "parallelism.dp_shard=2",
            "accelerator.fsdp.min_num_params=40000",
            "accelerator.fsdp.reshard_after_forward=false",
            "accelerator.fsdp.cpu_offload=true",
            f"output_dir={tmp_path / 'fsdp'}",
        ],
        nproc=nproc,
        timeout=180,
    )
    ddp = layout_run("ddp_b4")

    assert "FSDP wrap units (accelerator.fsdp.min_num_params=40000): 2 units, e.g. model.encoder" in fsdp.stdout
    assert "topology: FSDP2: 2 shards" in fsdp.stdout
    fsdp_metrics, ddp_metrics = interval_metrics(tmp_path / "fsdp"), ddp.metrics()
    assert [m["step"] for m in fsdp_metrics] == [m["step"] for m in ddp_metrics] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm"):  # bounds: tests/tolerances.py
        assert_same_series([m[key] for m in fsdp_metrics], [m[key] for m in ddp_metrics], list(range(6)), key)
    assert_same_weights(last_weights(tmp_path / "fsdp"), ddp.weights(), num_updates=6, lr=1e-4)


@pytest.mark.dist
def test_tied_weights_split_across_units_stop_before_the_first_step(
    wrap_checks: list[dict[str, Any]],
) -> None:
    for rank_result in wrap_checks:  # every rank refuses, so none waits in a collective for the others
        message = rank_result["tied_error"]
        assert message is not None
        assert message.startswith("FSDP cannot split tied weights across wrap units")
        assert "head.weight (unit <root>)" in message
        assert "blocks.1.linear.weight (unit blocks.1)" in message
        assert "TiedToyPolicy._fsdp_wrap_modules=['ToyBlock']" in message
        assert "Fix: wrap the repeated block class (accelerator.fsdp.wrap_modules)" in message


@pytest.mark.dist
def test_policy_without_wrap_units_fails_at_startup(wrap_checks: list[dict[str, Any]]) -> None:
    for rank_result in wrap_checks:
        message = rank_result["undeclared_error"]
        assert message is not None
        assert message.startswith(
            "accelerator.fsdp.wrap_modules=None and accelerator.fsdp.min_num_params=None: UndeclaredToyPolicy "
            "declares no _fsdp_wrap_modules, so a sharded run would wrap only the root module"
        )
        # Which size threshold gives how many units, and the class-name alternative.
        assert re.search(r"Fix: accelerator\.fsdp\.min_num_params=\d+ gives \d+ units", message), message
        assert "or accelerator.fsdp.wrap_modules='[\"MyBlock\"]'" in message


@pytest.mark.dist
def test_mixed_precision_policy_is_built_from_its_fields_alone(wrap_checks: list[dict[str, Any]]) -> None:
    """param_dtype=bfloat16 alone under accelerator.mixed_precision=bf16: the plugin carries exactly those
    fields (nothing derived from bf16), and on torch 2.13 the unset reduce_dtype reduces in bfloat16."""
    for rank_result in wrap_checks:
        assert rank_result["plugin_policy"] == {
            "param_dtype": "torch.bfloat16",
            "reduce_dtype": "None",
            "output_dtype": "None",
            "cast_forward_inputs": "True",
        }
        assert rank_result["units"] == ["blocks.0", "blocks.1"]
        # One reduce-scatter per unit: two blocks and the root, all in the compute dtype.
        assert rank_result["reduce_dtypes_unset"] == ["torch.bfloat16"] * 3
        assert rank_result["reduce_dtypes_explicit_float32"] == ["torch.float32"]
        # The sharded parameters (and the optimizer) stay float32.
        assert rank_result["sharded_param_dtypes"] == ["torch.float32"]
        assert 0 < rank_result["loss"] < 10


@pytest.mark.dist
def test_ignored_params_stay_equal_across_replicas(ignored: list[dict[str, Any]]) -> None:
    """ignored_modules with reshard_after_forward=false and cpu_offload=true: the options reach the units,
    the ignored parameters train identically on both replicas, and the model matches one process."""
    rank0, rank1 = ignored
    assert rank0["ignored_names"] == [
        "blocks.0.linear.weight",
        "blocks.0.linear.bias",
        "head.weight",
        "head.bias",
    ]
    assert rank0["sharded_names"] == [
        "encoder.weight",
        "encoder.bias",
        "blocks.1.linear.weight",
        "blocks.1.linear.bias",
    ]
    assert rank0["unit_options"] == {
        "reshards_after_forward": False,
        "offload_policy": "CPUOffloadPolicy(pin_memory=False)",
    }
    assert rank0["ignored_moved"] > 1e-3  # they train ...
    assert rank0["ignored_synced"] == rank1["ignored_synced"]  # ... bit-identically on both replicas
    # and the whole model matches one process trained on both ranks' batches.
    assert rank0["max_abs_diff_vs_one_process"] < 1e-6
    assert rank1["max_abs_diff_vs_one_process"] < 1e-6


@pytest.mark.dist
def test_ignored_params_drift_without_sync_ignored_grads(ignored: list[dict[str, Any]]) -> None:
    rank0, rank1 = ignored
    for name in rank0["ignored_names"]:
        drift = max(
            abs(a - b) for a, b in zip(rank0["ignored_unsynced"][name], rank1["ignored_unsynced"][name])
        )
        assert drift > 1e-4, name


@pytest.mark.dist
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(fp16_overflow: list[dict[str, Any]]) -> None:
    rank0, rank1 = fp16_overflow
    for rank_result in fp16_overflow:
        assert rank_result["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.FSDP")
        assert rank_result["scaler"] == "GradScaler(cpu)"
        assert rank_result["initial_scale"] == 65536.0
        *backing_off, clean, overflow, _ = rank_result["steps"]
        # Natural overflows while the scale backs off: every rank skips, weights untouched, scale halved.
        for num_skips, skipped in enumerate(backing_off, start=1):
            assert skipped == {
                **skipped,
                "synced": True,
                "skipped": True,
                "weights_changed": False,
                "scale": 65536.0 / 2**num_skips,
            }
        scale = 65536.0 / 2 ** len(backing_off)
        assert clean == {**clean, "synced": True, "skipped": False, "weights_changed": True, "scale": scale}
        # The injected inf sits on rank 1 only, yet both ranks skip and back off.
        assert overflow == {
            **overflow,
            "synced": True,
            "skipped": True,
            "weights_changed": False,
            "scale": scale / 2,
        }
    assert len(rank0["steps"]) == len(rank1["steps"]) <= MAX_FP16_WARMUP_STEPS
    assert rank0["steps"][-3]["loss"] != rank1["steps"][-3]["loss"]  # the ranks saw different data


@pytest.mark.dist
def test_fp16_overflow_without_sync_found_inf(fp16_overflow: list[dict[str, Any]]) -> None:
    """The counter-test: the same overflow with ``sync_found_inf`` switched off.

    Under DDP only the rank that saw the inf skips and the replicas part: ``sync_found_inf`` is what keeps
    them together. Under FSDP2 both ranks still skip, because on torch 2.13 the DTensor dispatcher already
    reduces ``found_inf`` (MAX) over the shard mesh inside ``_amp_foreach_non_finite_check_and_unscale_``
    (``torch.distributed.tensor._dispatch.found_inf_reduce_handler``); there ``sync_found_inf`` is a guard
    that does not rely on that internal.
    """
    rank0_step, rank1_step = (rank_result["steps"][-1] for rank_result in fp16_overflow)
    scale_before = fp16_overflow[0]["steps"][-2]["scale"]
    assert rank1_step["skipped"] and rank1_step["scale"] == scale_before / 2  # the rank with the inf
    if fp16_overflow[0]["distributed_type"] == "DistributedType.MULTI_CPU":  # DDP
        assert (
            not rank0_step["skipped"]
            and rank0_step["weights_changed"]
            and rank0_step["scale"] == scale_before
        )
    else:
        assert (
            rank0_step["skipped"]
            and not rank0_step["weights_changed"]
            and rank0_step["scale"] == scale_before / 2
        )


def test_mixed_precision_policy_ignores_accelerator_mixed_precision() -> None:
    """Once one field is set, the factory's policy has only the set fields, whatever mixed_precision says."""

    def policy(mixed_precision: str, **fields: Any) -> MixedPrecisionPolicy | None:
        fsdp = FSDPConfig(mixed_precision_policy=MixedPrecisionPolicyConfig(**fields))
        return _mixed_precision_policy(AcceleratorConfig(mixed_precision=mixed_precision, fsdp=fsdp))

    assert policy("bf16") is None  # nothing set: accelerate derives the policy from mixed_precision
    assert policy("bf16", reduce_dtype="float32") == MixedPrecisionPolicy(reduce_dtype=torch.float32)
    assert policy("fp16", param_dtype="float16", output_dtype="float32", cast_forward_inputs=False) == (
        MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32, cast_forward_inputs=False)
    )


if __name__ == "__main__":
    _scenario_main(*sys.argv[1:])
