"""Benchmark: accelerator.activation_checkpointing (peak activation memory) and accelerator.compile (compile time,
steady-state step time, and the loss against eager, alone and under DDP-2 / FSDP-2).

    python scripts/bench_ac_compile.py                              # all three parts; outputs/bench/bench_ac_compile.json
    python scripts/bench_ac_compile.py --parts memory --batch-size 32

Every model goes through the trainer's own path (accelerator factory, ``prepare_units``, ``Stepper``) on the CPU;
batches are random, normalised-looking, with per-sample seeds.

1. memory: one forward + backward of ACT (dim_model 512, 4 + 1 layers, chunk 50, VAE) and of Diffusion at
   LeRobot's default size (248.7M parameters), each with and without activation checkpointing, under torch's
   MemTracker: peak activation + temporary bytes. Goal: checkpointing at most half of it.
2. compile: one process, ACT (dim_model 256) and Diffusion (aloha_diffusion's U-Net, 16.6M parameters): the first
   compiled step's extra time (the compile), the median step time eager and compiled, and the largest relative
   loss difference over 20 steps (goal <= 1e-4). CPU inductor compiles C++ with the system's g++. torch's compile
   caches are off, so the compile time is that of a first run, not of whatever an earlier run left on disk.
3. composition: the pusht_debug_diffusion U-Net on DDP-2 and on FSDP-2 (units by size), 20 steps compiled and
   with activation checkpointing against the same 20 steps eager (2 spawned processes each, gloo): the largest
   relative loss difference (goal <= 1e-4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from benchmarking import BenchResult, report, run_on_ranks

FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [14]},
    "observation.environment_state": {"dtype": "float32", "shape": [3]},
    "action": {"dtype": "float32", "shape": [14]},
}
NUM_LOSS_STEPS = 20
LOSS_GOAL = 1e-4
COMPOSITION_MIN_NUM_PARAMS = 20_000  # the small U-Net's size-rule units (tests/dist/test_diffusion_layouts.py)


def _policy_configs(part: str) -> dict[str, Any]:
    from lerobot_mg.policies.act import ACTConfig
    from lerobot_mg.policies.diffusion import DiffusionConfig

    if part == "memory":
        return {"act": ACTConfig(chunk_size=50, n_action_steps=50, dropout=0.0),
                "diffusion": DiffusionConfig()}
    if part == "compile":
        return {"act": ACTConfig(dim_model=256, dim_feedforward=1024, chunk_size=50, n_action_steps=50, dropout=0.0,
                                 use_vae=False),
                "diffusion": DiffusionConfig(down_dims=[128, 256, 512])}
    return {"diffusion": DiffusionConfig(horizon=8, n_action_steps=4, down_dims=[32, 64], diffusion_step_embed_dim=32)}


def _batches(policy_cfg: Any, batch_size: int, num_batches: int, seed: int) -> list[dict[str, torch.Tensor]]:
    from lerobot_mg.data.sampler import sample_seeds
    from lerobot_mg.policies.base import SAMPLE_SEED_KEY

    generator = torch.Generator().manual_seed(seed)
    history = policy_cfg.observation_delta_indices
    frames = [] if history is None else [len(history)]
    chunk = len(policy_cfg.action_delta_indices)
    batches = []
    for step in range(num_batches):
        batch = {key: torch.randn(batch_size, *frames, *spec["shape"], generator=generator)
                 for key, spec in FEATURES.items() if key != "action"}
        batch["action"] = torch.randn(batch_size, chunk, 14, generator=generator).clamp(-1, 1)
        batch["action_is_pad"] = torch.zeros(batch_size, chunk, dtype=torch.bool)
        batch[SAMPLE_SEED_KEY] = sample_seeds(seed, step, torch.arange(batch_size))
        batches.append(batch)
    return batches


def _trainer_pieces(policy_cfg: Any, acc_overrides: dict[str, Any], dp_shard: int = 1, rank: int = 0,
                    world_size: int = 1):
    """(stepper, policy) built as train() builds them. Collective when world_size > 1."""
    from accelerate.utils import set_seed

    from lerobot_mg.config.schema import AcceleratorConfig, FSDPConfig, TrainConfig
    from lerobot_mg.distributed.accelerator import build_accelerator, prepare_units
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.optim import make_optimizer
    from lerobot_mg.policies.registry import make_policy
    from lerobot_mg.step import Stepper

    fsdp = FSDPConfig(min_num_params=acc_overrides.pop("min_num_params", None))
    cfg = TrainConfig(policy=policy_cfg, accelerator=AcceleratorConfig(cpu=True, fsdp=fsdp, **acc_overrides))
    dims = ParallelDims.resolve(1, dp_shard, world_size, rank, rank)
    accelerator = build_accelerator(cfg.accelerator, dims)
    set_seed(0)
    policy = make_policy(cfg.policy, FEATURES)
    prepare_units(accelerator, policy, cfg.accelerator, dims)
    optimizer = make_optimizer(policy, cfg.optimizer)
    model, optimizer = accelerator.prepare(policy, optimizer)
    return Stepper(accelerator, model, optimizer, None, lambda batch: batch, cfg.optimizer.grad_clip_norm, dims), policy


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    for state in (AcceleratorState, GradientState, PartialState):
        state._reset_state()


# --- 1. peak activation memory -----------------------------------------------------------------------------


def _peak_activation_bytes(policy_cfg: Any, checkpointing: bool, batch_size: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    stepper, policy = _trainer_pieces(policy_cfg, {"activation_checkpointing": checkpointing})
    (batch,) = _batches(policy_cfg, batch_size, 1, seed=0)
    tracker = MemTracker()
    tracker.track_external(stepper.model, stepper.optimizer)
    with tracker:
        loss, _ = stepper.model(batch)
        loss.backward()
    stats = tracker.memory_tracking[stepper.model]
    peaks = [snapshot for state in (_ModState.PEAK_FW, _ModState.PEAK_BW) for snapshot in stats.snapshots[state]]
    _reset_accelerate()
    return max(
        by_type[_MemRefType.ACT] + by_type[_MemRefType.TEMP] for snapshot in peaks for by_type in snapshot.values()
    )


def memory_results(batch_size: int) -> list[BenchResult]:
    results = []
    for name, policy_cfg in _policy_configs("memory").items():
        without = _peak_activation_bytes(policy_cfg, False, batch_size)
        with_checkpointing = _peak_activation_bytes(policy_cfg, True, batch_size)
        print(f"{name}: peak activation memory at batch {batch_size}: {without / 2**20:.1f} MiB, with activation "
              f"checkpointing {with_checkpointing / 2**20:.1f} MiB", flush=True)
        results += [
            BenchResult(f"{name}_peak_activation_bytes_batch{batch_size}", without, None, "bytes"),
            BenchResult(f"{name}_peak_activation_bytes_batch{batch_size}_checkpointed", with_checkpointing, None,
                        "bytes"),
            BenchResult(f"{name}_activation_memory_ratio_checkpointed_over_plain", with_checkpointing / without,
                        0.5, "ratio"),
        ]
    return results


# --- 2. compile time and step time -------------------------------------------------------------------------


def _timed_losses(policy_cfg: Any, compile_units: bool, batches: list[dict[str, torch.Tensor]]) -> tuple[list[float], list[float]]:
    stepper, _ = _trainer_pieces(policy_cfg, {"compile": compile_units})
    losses, seconds = [], []
    for batch in batches:
        start = time.perf_counter()
        losses.append(float(stepper.step(batch).losses["loss"]))
        seconds.append(time.perf_counter() - start)
    _reset_accelerate()
    return losses, seconds


def _max_relative_difference(values: list[float], reference: list[float]) -> float:
    return max(abs(value - expected) / abs(expected) for value, expected in zip(values, reference))


def compile_results(batch_size: int) -> list[BenchResult]:
    torch.compiler.config.force_disable_caches = True
    results = []
    for name, policy_cfg in _policy_configs("compile").items():
        batches = _batches(policy_cfg, batch_size, NUM_LOSS_STEPS, seed=1)
        eager_losses, eager_seconds = _timed_losses(policy_cfg, False, batches)
        compiled_losses, compiled_seconds = _timed_losses(policy_cfg, True, batches)
        # Steps 1-2 may (re)compile (e.g. a second graph for the optimizer-free warm path); the median of the rest
        # is the steady state.
        eager_step = statistics.median(eager_seconds[3:])
        compiled_step = statistics.median(compiled_seconds[3:])
        compile_seconds = sum(compiled_seconds[:3]) - 3 * compiled_step
        print(f"{name}: compile {compile_seconds:.1f} s; step at batch {batch_size}: eager {eager_step * 1e3:.1f} ms, "
              f"compiled {compiled_step * 1e3:.1f} ms", flush=True)
        results += [
            BenchResult(f"{name}_compile_seconds", compile_seconds, None, "s"),
            BenchResult(f"{name}_eager_step_seconds_batch{batch_size}", eager_step, None, "s"),
            BenchResult(f"{name}_compiled_step_seconds_batch{batch_size}", compiled_step, None, "s"),
            BenchResult(f"{name}_step_time_ratio_compiled_over_eager", compiled_step / eager_step, None, "ratio"),
            BenchResult(f"{name}_compiled_loss_max_relative_difference_{NUM_LOSS_STEPS}_steps",
                        _max_relative_difference(compiled_losses, eager_losses), LOSS_GOAL, "ratio"),
        ]
    return results


# --- 3. compile and checkpointing under DDP-2 / FSDP-2 ------------------------------------------------------


def _composition_worker(rank: int, world_size: int, port: int, dp_shard: int, transformed: bool, batch_size: int,
                        ) -> list[float]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    policy_cfg = _policy_configs("composition")["diffusion"]
    overrides: dict[str, Any] = {"compile": transformed, "activation_checkpointing": transformed}
    if dp_shard > 1:
        overrides["min_num_params"] = COMPOSITION_MIN_NUM_PARAMS
    stepper, _ = _trainer_pieces(policy_cfg, overrides, dp_shard=dp_shard, rank=rank, world_size=world_size)
    # Each rank its own half of every global batch (as the sampler gives them).
    batches = _batches(policy_cfg, 2 * batch_size, NUM_LOSS_STEPS, seed=2)
    return [
        float(stepper.step({key: value[rank * batch_size : (rank + 1) * batch_size] for key, value in batch.items()})
              .losses["loss"])
        for batch in batches
    ]


def _composition_losses(dp_shard: int, transformed: bool, batch_size: int) -> list[float]:
    return run_on_ranks(_composition_worker, (dp_shard, transformed, batch_size))


def composition_results(batch_size: int) -> list[BenchResult]:
    results = []
    for layout, dp_shard in (("ddp2", 1), ("fsdp2", 2)):
        eager = _composition_losses(dp_shard, False, batch_size)
        transformed = _composition_losses(dp_shard, True, batch_size)
        difference = _max_relative_difference(transformed, eager)
        print(f"{layout}: compile + activation checkpointing vs eager, {NUM_LOSS_STEPS} steps: largest relative loss "
              f"difference {difference:.2e} (losses {eager[0]:.4f} -> {eager[-1]:.4f})", flush=True)
        results.append(BenchResult(f"diffusion_{layout}_compiled_checkpointed_loss_max_relative_difference", difference,
                                   LOSS_GOAL, "ratio"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["memory", "compile", "composition"],
                        default=["memory", "compile", "composition"])
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = {"memory": memory_results, "compile": compile_results, "composition": composition_results}
    results = [result for part in args.parts for result in parts[part](args.batch_size)]
    report("bench_ac_compile", results)


if __name__ == "__main__":
    main()
