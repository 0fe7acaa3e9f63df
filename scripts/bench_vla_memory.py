"""Benchmark: full-size SmolVLA's peak private memory per rank under DDP-2 and FSDP-2 on CPU, against the memory plan.

    python scripts/bench_vla_memory.py               # outputs/bench/bench_vla_memory.json (about 10 GB of host RAM)
    python scripts/bench_vla_memory.py --steps 3 --layouts fsdp2

SmolVLA as LeRobot 0.6.1 builds it at full size (450,046,176 parameters, 99,880,992 trained by default: the expert
and the projections; the VLM frozen), randomly initialised in float32 (``policy.load_vlm_weights=false``: nothing is
downloaded), one 480x640 camera, state and action of 14, a prompt of ``tokenizer_max_length`` token ids (the batch
the processor would give; no tokenizer needed), batch 2. Each layout runs as the trainer builds it (the run config
of ``policy=smolvla batch_size=2``, ``prepare_units``, the optimizer of SmolVLA's preset, ``prepare``, the Stepper)
on 2 real processes (gloo, one thread each), without evaluation or checkpoints, for a few optimizer steps.

What is measured, per rank: the peak of the process's private anonymous memory (``RssAnon`` of ``/proc/self/status``,
sampled every 5 ms by a thread, and ``Private_Clean + Private_Dirty`` of ``smaps_rollup`` after each step) during
the steps, above the same process before the policy was built (imports, process group and config already there).
Memory that the build frees (FSDP2 replaces each full parameter by its shard) is handed back to the system first
(``malloc_trim``), and the ranks return every freed block of 1 MiB or more at once (``MALLOC_MMAP_THRESHOLD_``), so
the figure is what training holds, not what glibc kept.

What it is compared with: ``plan_memory`` for the same config and layout (what ``plan=true`` prints): its persistent
state (parameters, gradients, AdamW state), what FSDP2 holds gathered at the peak, and the activations. Where the
plan has no activation estimate for the policy (its forward does not run on the meta device), the bytes autograd
saved for backward in one unsharded step are used in its place (the plan's own account, on real tensors; the same
for both layouts: each rank runs a batch of 2). Goals: peak / (persistent + gathered + activations) within 10 %
(0.9 to 1.1) for each layout; persistent state of FSDP-2 over DDP-2 <= 1/2 + 0.02, planned and measured on the
prepared model (``rank_bytes``); the ratio of the measured peaks is reported beside them.

Published figures for comparison (LeRobot's own runs, GPU, not this benchmark): pi0 under LeRobot's FSDP without a
wrap unit, 79.6 GB per GPU on 2 GPUs against 16.5 GB on one (awslabs/awsome-distributed-ai#1174: sharding made
each GPU hold more); SmolVLA's authors present it as trainable on a single GPU (Shukor et al. 2025, "SmolVLA",
arXiv:2506.01844), without a per-GPU figure.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from benchmarking import BenchResult, GoalIs, report, run_on_ranks
from torch.multiprocessing.reductions import StorageWeakRef

CAMERA = "observation.images.top"
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [14]},
    CAMERA: {"dtype": "video", "shape": [480, 640, 3], "names": ["height", "width", "channels"]},
    "action": {"dtype": "float32", "shape": [14]},
}
BATCH_SIZE = 2
LAYOUTS = {"ddp2": 1, "fsdp2": 2}  # name -> dp_shard on 2 ranks
WITHIN = 0.10  # measured / planned goal: 1 +- WITHIN
RATIO_GOAL = 0.5 + 0.02  # FSDP-2 / DDP-2, persistent state
MIB = 2**20


def overrides(dp_shard: int) -> list[str]:
    return ["policy=smolvla", "policy.load_vlm_weights=false", f"batch_size={BATCH_SIZE}", "eval.n_episodes=0",
            f"parallelism.dp_shard={dp_shard}", "torch_threads=1"]


def _config(dp_shard: int):  # noqa: ANN202 (TrainConfig is imported late, after the rank's baseline)
    """The run config a user gets from ``lerobot-mg-train`` with these overrides (the same Hydra composition)."""
    from hydra import compose, initialize_config_dir

    from lerobot_mg.config import register_configs
    from lerobot_mg.config.loading import CONF_DIR, override_keys, run_config

    register_configs()
    args = overrides(dp_shard)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=args)
    return run_config(composed, frozenset(override_keys(args)))


def _rss_anon() -> int:
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith("RssAnon:"):
                return 1024 * int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def _private() -> int:
    with open("/proc/self/smaps_rollup") as lines:
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return 1024 * sum(int(fields[name].split()[0]) for name in ("Private_Clean", "Private_Dirty"))


def _trim() -> None:
    """Hand the heap's free memory back to the system (glibc), so RSS is what is still allocated."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


class PeakSampler:
    """The peak of RssAnon while it runs, sampled every ``period`` seconds on a thread of its own."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.peak = period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(self.period)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def random_batch(policy: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The policy's example batch (every key the processor gives it) filled with random values."""
    from lerobot_mg.policies.smolvla.vlm import smolvlm_config

    generator = torch.Generator().manual_seed(seed)
    batch = policy.example_batch(BATCH_SIZE)
    for key, value in batch.items():
        if key == CAMERA:
            batch[key] = torch.rand(value.shape, generator=generator)
        elif value.is_floating_point():
            batch[key] = torch.randn(value.shape, generator=generator)
    vocab = smolvlm_config(policy.config).text_config.vocab_size
    tokens = next(key for key, value in batch.items() if value.dtype == torch.long and value.ndim == 2)
    batch[tokens] = torch.randint(0, vocab, batch[tokens].shape, generator=generator)
    return batch


def _plan(cfg, dims) -> dict[str, int]:  # noqa: ANN001
    from lerobot_mg.distributed.memory import plan_memory
    from lerobot_mg.policies.registry import make_policy

    with torch.device("meta"):
        policy = make_policy(cfg.policy, FEATURES)
    plan = plan_memory(cfg, dims, policy)
    held, transient = plan.busiest, plan.transient
    assert transient is not None
    print("\n".join(plan.describe()), flush=True)
    estimate = transient.activations
    return {"num_parameters": plan.num_parameters, "persistent": held.total, "parameters": held.parameters,
            "gradients": held.gradients, "optimizer_state": held.optimizer_state, "gathered": transient.gathered,
            "activations": None if estimate is None else estimate.total}


@contextmanager
def saved_for_backward(model: torch.nn.Module) -> Iterator[list[int]]:
    """Bytes autograd saves for backward while the block runs (each storage once, the model's parameters left out):
    the plan's activation account, on real tensors. Yields a one-element list that holds the total afterwards."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in params:
            saved.setdefault(ref, tensor.untyped_storage().nbytes())
        return tensor

    total = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total
    total[0] = sum(saved.values())


def _worker(rank: int, world_size: int, port: int, dp_shard: int, steps: int) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate.utils import set_seed

    from lerobot_mg.distributed.accelerator import build_accelerator, prepare, prepare_units
    from lerobot_mg.distributed.memory import rank_bytes
    from lerobot_mg.distributed.parallel_dims import ParallelDims
    from lerobot_mg.optim import make_optimizer
    from lerobot_mg.policies.registry import make_policy
    from lerobot_mg.step import Stepper

    cfg = _config(dp_shard)
    dims = ParallelDims.resolve(1, dp_shard, world_size, rank, rank, launched=True)
    set_seed(0)
    accelerator = build_accelerator(cfg.accelerator, dims)
    plan = _plan(cfg, dims) if rank == 0 else None
    _trim()
    baseline_anon, baseline_private = _rss_anon(), _private()
    with PeakSampler() as build:
        policy = make_policy(cfg.policy, FEATURES)
        prepare_units(accelerator, policy, cfg.accelerator, dims)
        optimizer = make_optimizer(policy, cfg.optimizer)
        model, optimizer = prepare(accelerator, policy, optimizer, dims)
    stepper = Stepper(accelerator, model, optimizer, None, lambda b: b, cfg.optimizer.grad_clip_norm, dims)
    batches = [random_batch(policy, seed=rank * 100 + step) for step in range(steps)]
    _trim()
    after_build = _rss_anon()
    private_peak, step_s, activations = 0, [], None
    with PeakSampler() as training:
        for index, batch in enumerate(batches):
            start = time.perf_counter()
            if index == 0 and dp_shard == 1:  # unsharded: every parameter is a plain tensor the hook can leave out
                with saved_for_backward(model) as saved:
                    stepper.step(batch)
                activations = saved[0]
            else:
                stepper.step(batch)
            step_s.append(time.perf_counter() - start)
            private_peak = max(private_peak, _private())
    held = rank_bytes(model, optimizer.optimizer)
    record = {"peak_anon": training.peak - baseline_anon, "peak_private": private_peak - baseline_private,
              "build_peak_anon": build.peak - baseline_anon, "after_build_anon": after_build - baseline_anon,
              "held": held, "step_s": step_s, "baseline_anon": baseline_anon,
              "activations": activations}
    records = [None] * world_size
    torch.distributed.all_gather_object(records, record)
    return {"plan": plan, "ranks": records}


def measure(layout: str, steps: int) -> dict:
    result = run_on_ranks(_worker, (LAYOUTS[layout], steps), world_size=2, timeout=1800)
    for rank, record in enumerate(result["ranks"]):
        print(f"{layout} rank {rank}: peak private anon {record['peak_anon'] / MIB:.0f} MiB (smaps after steps "
              f"{record['peak_private'] / MIB:.0f}), at build {record['build_peak_anon'] / MIB:.0f} MiB, after build "
              f"{record['after_build_anon'] / MIB:.0f} MiB, held {record['held']}, steps "
              f"{[round(s, 1) for s in record['step_s']]} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per layout")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The ranks (spawned: they read it at start) hand every block of 1 MiB or more back to the system when it is
    # freed, so that RSS follows what is allocated (glibc's dynamic threshold would keep freed blocks of up to 32 MiB).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MIB))
    load_before = os.getloadavg()[0]
    measured = {layout: measure(layout, args.steps) for layout in args.layouts}
    # The activations: the plan's estimate, else what one unsharded step saved for backward (the same account on
    # real tensors; it does not depend on the layout: each rank runs a batch of BATCH_SIZE).
    saved = next((r["activations"] for m in measured.values() for r in m["ranks"] if r["activations"]), None)
    results: list[BenchResult] = []
    for layout, outcome in measured.items():
        plan = outcome["plan"]
        peak = max(record["peak_anon"] for record in outcome["ranks"])
        activations = plan["activations"] if plan["activations"] is not None else saved
        planned = plan["persistent"] + plan["gathered"]
        results += [
            BenchResult(f"smolvla_{layout}_peak_private_mib_measured", round(peak / MIB), None, "MiB"),
            BenchResult(f"smolvla_{layout}_persistent_mib_planned", round(plan["persistent"] / MIB), None, "MiB"),
            BenchResult(f"smolvla_{layout}_gathered_mib_planned", round(plan["gathered"] / MIB), None, "MiB"),
            BenchResult(f"smolvla_{layout}_persistent_mib_measured",
                        round(max(r["held"]["total"] for r in outcome["ranks"]) / MIB), None, "MiB"),
        ]
        if activations is not None:
            results += [
                BenchResult(f"smolvla_{layout}_activations_mib" + ("_planned" if plan["activations"] else
                                                                  "_saved_by_one_step"),
                            round(activations / MIB), None, "MiB"),
                BenchResult(f"smolvla_{layout}_peak_over_planned_plus_activations",
                            round(peak / (planned + activations), 3), 1 + WITHIN, "x"),
                BenchResult(f"smolvla_{layout}_peak_over_planned_plus_activations_low",
                            round(peak / (planned + activations), 3), 1 - WITHIN, "x", GoalIs.AT_LEAST),
            ]
        results += [
            BenchResult(f"smolvla_{layout}_peak_over_planned_without_activations", round(peak / planned, 3), None,
                        "x"),
            BenchResult(f"smolvla_{layout}_build_peak_mib_measured",
                        round(max(r["build_peak_anon"] for r in outcome["ranks"]) / MIB), None, "MiB"),
            BenchResult(f"smolvla_{layout}_step_s", round(max(max(r["step_s"][1:] or r["step_s"])
                                                              for r in outcome["ranks"]), 1), None, "s"),
        ]
    if set(measured) == set(LAYOUTS):
        ddp, fsdp = measured["ddp2"], measured["fsdp2"]
        results += [
            BenchResult("smolvla_persistent_fsdp2_over_ddp2_planned",
                        round(fsdp["plan"]["persistent"] / ddp["plan"]["persistent"], 4), RATIO_GOAL, "ratio"),
            BenchResult("smolvla_persistent_fsdp2_over_ddp2_measured",
                        round(max(r["held"]["total"] for r in fsdp["ranks"])
                              / max(r["held"]["total"] for r in ddp["ranks"]), 4), RATIO_GOAL, "ratio"),
            BenchResult("smolvla_peak_fsdp2_over_ddp2_measured",
                        round(max(r["peak_anon"] for r in fsdp["ranks"]) / max(r["peak_anon"] for r in ddp["ranks"]),
                              4), None, "ratio"),
        ]
    results += [BenchResult("smolvla_num_parameters", next(iter(measured.values()))["plan"]["num_parameters"], None,
                            "parameters"),
                BenchResult("load_average_1min_before", round(load_before, 2), None, ""),
                BenchResult("load_average_1min_after", round(os.getloadavg()[0], 2), None, "")]
    report("bench_vla_memory", results)


if __name__ == "__main__":
    main()
