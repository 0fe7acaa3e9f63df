"""Benchmark: per-rank training-state memory under DDP-2 vs FSDP-2, and lerobot_mg's loop step vs a bare loop.

    python scripts/bench_layouts.py                  # CPU, gloo: ACT and Diffusion; outputs/bench/bench_layouts.json
    python scripts/bench_layouts.py --policies act --dim-model 512 --steps 30

1. Memory: the same policy under DDP-2 and FSDP-2 (2 spawned processes each, gloo), after one optimizer step:
   bytes of parameters + gradients + optimizer state held by rank 0. ACT (dim_model 512, chunk 50): FSDP-2 /
   DDP-2 goal <= 0.525 (limit 0.5). Diffusion at LeRobot's default size (248.7M parameters, U-Net widths
   512-1024-2048; no wrap units of its own, so FSDP-2 shards by size, min_num_params=16M): goal <= 0.55. About
   10 GB of host memory for the two DDP ranks.
2. Overhead (ACT): one process, the same model, batches and optimizer; lerobot_mg's Stepper (Accelerate, the
   preprocessor, clipping, the scheduler) against a bare PyTorch loop doing the same math, interleaved in
   alternation, so machine noise hits both alike. Goal <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from benchmarking import BenchResult, report, run_on_ranks

# The embedded ALOHA dataset's state-only features.
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [14]},
    "observation.environment_state": {"dtype": "float32", "shape": [3]},
    "action": {"dtype": "float32", "shape": [14]},
}
# FSDP-2 units of the default Diffusion U-Net: the size rule's 9-unit suggestion (its start-up error lists them).
DIFFUSION_MIN_NUM_PARAMS = 16_000_000
DIFFUSION_BATCH_SIZE = 2  # the bytes measured do not depend on it; a 250M U-Net step on a CPU does
GOALS = {"act": 0.525, "diffusion": 0.55}


def _config(policy: str, args: argparse.Namespace):
    """The run config a user gets from ``lerobot-mg-train`` with these overrides: the same Hydra composition of
    conf/ (presets, schema defaults) and the same typed conversion."""
    from hydra import compose, initialize_config_dir

    from lerobot_mg.config import register_configs
    from lerobot_mg.config.loading import CONF_DIR, override_keys, run_config

    if policy == "act":
        overrides = [f"policy.dim_model={args.dim_model}", f"policy.dim_feedforward={4 * args.dim_model}",
                     "policy.chunk_size=50", "policy.n_action_steps=50", "policy.use_vae=false", "policy.dropout=0",
                     f"batch_size={args.batch_size}"]
    else:  # LeRobot's default sizes
        overrides = ["policy=diffusion", f"batch_size={DIFFUSION_BATCH_SIZE}",
                     f"accelerator.fsdp.min_num_params={DIFFUSION_MIN_NUM_PARAMS}"]
    overrides.append("scheduler=constant")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=overrides)
    return run_config(composed, frozenset(override_keys(overrides)))


def policy_batch(policy_cfg, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random normalised batch shaped as the dataset would give ``policy_cfg``: observation history (if any),
    action chunk, padding mask."""
    history = policy_cfg.observation_delta_indices
    frames = [] if history is None else [len(history)]
    chunk = len(policy_cfg.action_delta_indices)
    batch = {
        key: torch.randn(batch_size, *frames, *spec["shape"], generator=generator)
        for key, spec in FEATURES.items() if key != "action"
    }
    batch["action"] = torch.randn(batch_size, chunk, *FEATURES["action"]["shape"], generator=generator)
    batch["action_is_pad"] = torch.zeros(batch_size, chunk, dtype=torch.bool)
    return batch


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _memory_worker(rank: int, world_size: int, port: int, shard: bool, policy_name: str,
                   args: argparse.Namespace) -> dict[str, int]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate.utils import set_seed

    from lerobot_mg.distributed.accelerator import build_accelerator, prepare_units
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.optim import make_optimizer
    from lerobot_mg.policies.registry import make_policy
    from lerobot_mg.step import Stepper

    cfg = _config(policy_name, args)
    cfg.parallelism.dp_shard = world_size if shard else 1
    dims = ParallelDims.resolve(1, cfg.parallelism.dp_shard, world_size, rank, rank)
    set_seed(0)
    accelerator = build_accelerator(cfg.accelerator, dims)
    policy = make_policy(cfg.policy, FEATURES)
    prepare_units(accelerator, policy, cfg.accelerator, dims)
    optimizer = make_optimizer(policy, cfg.optimizer)
    model, optimizer = accelerator.prepare(policy, optimizer)
    stepper = Stepper(accelerator, model, optimizer, None, lambda b: b, cfg.optimizer.grad_clip_norm, dims)
    generator = torch.Generator().manual_seed(rank)
    # One step allocates the optimizer state; one more backward leaves the (reduced) gradients in place.
    stepper.step(policy_batch(cfg.policy, cfg.batch_size, generator))
    loss, _ = model(policy_batch(cfg.policy, cfg.batch_size, generator))
    accelerator.backward(loss)
    param_bytes = sum(_local_bytes(p) for p in model.parameters())
    grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim_bytes = sum(
        _local_bytes(v) for state in optimizer.optimizer.state.values() for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {"params": param_bytes, "grads": grad_bytes, "optim": optim_bytes,
            "num_params": sum(p.numel() for p in policy.parameters())}


def _measure_memory(shard: bool, policy_name: str, args: argparse.Namespace) -> dict:
    return run_on_ranks(_memory_worker, (shard, policy_name, args))


def _overhead(args: argparse.Namespace) -> tuple[float, float]:
    from accelerate.utils import set_seed

    from lerobot_mg.distributed.accelerator import build_accelerator
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.optim import make_optimizer, make_scheduler
    from lerobot_mg.policies.registry import make_policy
    from lerobot_mg.step import Stepper

    cfg = _config("act", args)
    dims = ParallelDims.resolve(1, 1, 1)
    set_seed(0)
    accelerator = build_accelerator(cfg.accelerator, dims)
    ours = make_policy(cfg.policy, FEATURES)
    bare = make_policy(cfg.policy, FEATURES)
    bare.load_state_dict(ours.state_dict())
    optimizer = make_optimizer(ours, cfg.optimizer)
    scheduler = make_scheduler(optimizer, cfg.scheduler, 10_000)
    model, optimizer = accelerator.prepare(ours, optimizer)
    stepper = Stepper(accelerator, model, optimizer, scheduler, lambda b: b, cfg.optimizer.grad_clip_norm, dims)
    bare_opt = make_optimizer(bare, cfg.optimizer)
    bare_sched = make_scheduler(bare_opt, cfg.scheduler, 10_000)

    def bare_step(batch):
        loss, _ = bare(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), cfg.optimizer.grad_clip_norm)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        bare_sched.step()
        float(loss.detach())

    generator = torch.Generator().manual_seed(0)
    batches = [policy_batch(cfg.policy, cfg.batch_size, generator) for _ in range(args.steps)]
    for batch in batches[:3]:  # warm-up both
        stepper.step(batch)
        bare_step(batch)
    ours_times, bare_times = [], []
    for batch in batches:
        start = time.perf_counter()
        stepper.step(batch)
        ours_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        bare_step(batch)
        bare_times.append(time.perf_counter() - start)
    return statistics.median(ours_times), statistics.median(bare_times)


def _memory_results(policy_name: str, args: argparse.Namespace) -> list[BenchResult]:
    ddp, fsdp = _measure_memory(False, policy_name, args), _measure_memory(True, policy_name, args)
    total = {"DDP-2": ddp["params"] + ddp["grads"] + ddp["optim"], "FSDP-2": fsdp["params"] + fsdp["grads"] + fsdp["optim"]}
    print(f"{policy_name}, {ddp['num_params'] / 1e6:.2f}M parameters, fp32, AdamW; bytes held by rank 0 after one step")
    print(f"{'':8}{'params':>14}{'grads':>14}{'optimizer':>14}{'total':>14}")
    for name, r in (("DDP-2", ddp), ("FSDP-2", fsdp)):
        print(f"{name:8}{r['params']:>14,}{r['grads']:>14,}{r['optim']:>14,}{total[name]:>14,}")
    return [
        BenchResult(f"{policy_name}_num_params", ddp["num_params"], None, "parameters"),
        BenchResult(f"{policy_name}_ddp2_rank0_bytes", total["DDP-2"], None, "bytes"),
        BenchResult(f"{policy_name}_fsdp2_rank0_bytes", total["FSDP-2"], None, "bytes"),
        BenchResult(f"{policy_name}_memory_ratio_fsdp2_over_ddp2", total["FSDP-2"] / total["DDP-2"],
                    GOALS[policy_name], "ratio"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", choices=sorted(GOALS), default=sorted(GOALS))
    parser.add_argument("--dim-model", type=int, default=512, help="ACT's width")
    parser.add_argument("--batch-size", type=int, default=16, help="ACT's batch")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = [result for policy in args.policies for result in _memory_results(policy, args)]
    if "act" in args.policies:
        ours, bare = _overhead(args)
        print(f"loop step, 1 process: lerobot_mg {ours * 1e3:.2f} ms vs bare PyTorch {bare * 1e3:.2f} ms (medians)")
        results.append(BenchResult("act_step_time_ratio_lerobot_mg_over_bare", ours / bare, 1.05, "ratio"))
    report("bench_layouts", results)


if __name__ == "__main__":
    main()
