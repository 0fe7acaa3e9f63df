"""Benchmark: per-rank training-state memory under DDP-2 vs FSDP-2, and lerobot_mg's loop step vs a bare loop.

    python scripts/bench_layouts.py                  # CPU, gloo: prints both ratios
    python scripts/bench_layouts.py --dim-model 512 --steps 30

1. Memory: the same ACT under DDP-2 and FSDP-2 (2 spawned processes each, gloo), after one optimizer step:
   bytes of parameters + gradients + optimizer state held by rank 0. FSDP-2 / DDP-2 goal <= 0.525 (limit 0.5).
2. Overhead: one process, the same model, batches and optimizer; lerobot_mg's Stepper (Accelerate, the
   preprocessor, clipping, the scheduler) against a bare PyTorch loop doing the same math, interleaved in
   alternation, so machine noise hits both alike. Goal <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [14]},
    "observation.environment_state": {"dtype": "float32", "shape": [3]},
    "action": {"dtype": "float32", "shape": [14]},
}


def _config(args: argparse.Namespace):
    from lerobot_mg.config.schema import TrainConfig

    cfg = TrainConfig()
    cfg.policy.dim_model = args.dim_model
    cfg.policy.dim_feedforward = 4 * args.dim_model
    cfg.policy.chunk_size = cfg.policy.n_action_steps = 50
    cfg.policy.use_vae = False
    cfg.policy.dropout = 0.0
    cfg.batch_size = args.batch_size
    cfg.scheduler.type = "constant"
    cfg.scheduler.num_warmup_steps = 0
    return cfg


def _batch(batch_size: int, chunk: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "observation.state": torch.randn(batch_size, 14, generator=generator),
        "observation.environment_state": torch.randn(batch_size, 3, generator=generator),
        "action": torch.randn(batch_size, chunk, 14, generator=generator),
        "action_is_pad": torch.zeros(batch_size, chunk, dtype=torch.bool),
    }


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _memory_worker(rank: int, world_size: int, port: int, shard: bool, args: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate.utils import set_seed

    from lerobot_mg.distributed.accelerator import build_accelerator, shard_units
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.optim import make_optimizer
    from lerobot_mg.policies.registry import make_policy
    from lerobot_mg.step import Stepper

    cfg = _config(args)
    cfg.parallelism.dp_shard = world_size if shard else 1
    dims = ParallelDims.resolve(1, cfg.parallelism.dp_shard, world_size, rank, rank)
    set_seed(0)
    accelerator = build_accelerator(cfg.accelerator, dims)
    policy = make_policy(cfg.policy, FEATURES)
    if shard:
        shard_units(accelerator, policy, cfg.accelerator.fsdp)
    optimizer = make_optimizer(policy, cfg.optimizer)
    model, optimizer = accelerator.prepare(policy, optimizer)
    stepper = Stepper(accelerator, model, optimizer, None, lambda b: b, cfg.optimizer.grad_clip_norm, dims)
    generator = torch.Generator().manual_seed(rank)
    # One step allocates the optimizer state; one more backward leaves the (reduced) gradients in place.
    stepper.step(_batch(cfg.batch_size, cfg.policy.chunk_size, generator))
    loss, _ = model(_batch(cfg.batch_size, cfg.policy.chunk_size, generator))
    accelerator.backward(loss)
    param_bytes = sum(_local_bytes(p) for p in model.parameters())
    grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim_bytes = sum(
        _local_bytes(v) for state in optimizer.optimizer.state.values() for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    if rank == 0:
        out.put({"params": param_bytes, "grads": grad_bytes, "optim": optim_bytes,
                 "num_params": sum(p.numel() for p in policy.parameters())})
    accelerator.end_training()


def _measure_memory(shard: bool, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_memory_worker, args=(r, 2, port, shard, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    return result


def _overhead(args: argparse.Namespace) -> tuple[float, float]:
    from accelerate.utils import set_seed

    from lerobot_mg.distributed.accelerator import build_accelerator
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.optim import make_optimizer, make_scheduler
    from lerobot_mg.policies.registry import make_policy
    from lerobot_mg.step import Stepper

    cfg = _config(args)
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
    batches = [_batch(cfg.batch_size, cfg.policy.chunk_size, generator) for _ in range(args.steps)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim-model", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    ddp, fsdp = _measure_memory(False, args), _measure_memory(True, args)
    total = {name: r["params"] + r["grads"] + r["optim"] for name, r in (("ddp", ddp), ("fsdp", fsdp))}
    print(f"ACT, {ddp['num_params'] / 1e6:.2f}M parameters, fp32, AdamW; bytes held by rank 0 after one step")
    print(f"{'':8}{'params':>14}{'grads':>14}{'optimizer':>14}{'total':>14}")
    for name, r in (("DDP-2", ddp), ("FSDP-2", fsdp)):
        key = "ddp" if name == "DDP-2" else "fsdp"
        print(f"{name:8}{r['params']:>14,}{r['grads']:>14,}{r['optim']:>14,}{total[key]:>14,}")
    ratio = total["fsdp"] / total["ddp"]
    print(f"memory ratio FSDP-2 / DDP-2 = {ratio:.4f}  (goal <= 0.525, limit 0.5)")

    ours, bare = _overhead(args)
    print(f"loop step, 1 process: lerobot_mg {ours * 1e3:.2f} ms vs bare PyTorch {bare * 1e3:.2f} ms (medians)")
    print(f"step time ratio lerobot_mg / bare = {ours / bare:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
