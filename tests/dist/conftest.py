"""Training runs shared by the distributed tests: each named run trains once per session, on first use.

The runs are built for exact comparison: no dropout, no VAE sampling (the trainer seeds each rank with
``seed + rank``, so per-rank noise would differ from one process). Action chunks of 10 frames do run past
episode ends, so padded positions are exercised: ``policy.l1_reduction=per_sample`` weighs every sample equally
(padded positions count as zero error), which keeps the mean of per-rank losses equal to the one-process loss
(LeRobot's default, the mean over each rank's non-padded entries, would weigh the ranks' samples differently).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lerobot_mg.accounting.ledger import read_ledger
from tests.launch_utils import TINY_RUN, interval_metrics, last_weights, run_train, shared_by_workers

DETERMINISTIC_RUN = [
    *TINY_RUN,
    "policy.dropout=0",
    "policy.use_vae=false",
    "policy.l1_reduction=per_sample",
    "policy.chunk_size=10",
    "policy.n_action_steps=10",
    "log_freq=1",
    "optimizer.lr=1e-4",  # test_layouts bounds noise-only weights by num_updates x lr
]
# The one-process references run on another SIMD kernel than the distributed runs (on a CPU with AVX-512; on an
# AVX2 CPU it is the same one): their comparison must hold on any CPU, not only the one that wrote it.
OTHER_KERNEL = {"ATEN_CPU_CAPABILITY": "avx2"}
# name -> (number of processes, overrides). Every family shares one effective batch per optimizer update:
# 8 for single/DDP/FSDP, 16 for HSDP on 4 ranks. Accumulating runs take twice the loop steps and log every
# second step, so their log lines fall on optimizer updates. The runs that tests/dist/test_ema_runs.py compares
# keep the EMA of their weights too (it never changes the weights).
LAYOUT_RUNS: dict[str, tuple[int, list[str]]] = {
    "single_b8": (1, ["batch_size=8", "steps=6", "ema.enable=true"]),
    "ddp_b4": (2, ["batch_size=4", "steps=6"]),
    "fsdp_b4": (2, ["batch_size=4", "steps=6", "parallelism.dp_shard=2", "ema.enable=true"]),
    "ddp_b2_accum2": (2, ["batch_size=2", "steps=12", "log_freq=2", "accelerator.gradient_accumulation.steps=2"]),
    "fsdp_b2_accum2": (2, ["batch_size=2", "steps=12", "log_freq=2", "accelerator.gradient_accumulation.steps=2",
                          "parallelism.dp_shard=2"]),
    "single_b16": (1, ["batch_size=16", "steps=6", "ema.enable=true"]),
    "hsdp_b4": (4, ["batch_size=4", "steps=6", "parallelism.dp_replicate=2", "parallelism.dp_shard=2",
                    "ema.enable=true"]),
    "hsdp_b2_accum2": (4, ["batch_size=2", "steps=12", "log_freq=2", "accelerator.gradient_accumulation.steps=2",
                          "parallelism.dp_replicate=2", "parallelism.dp_shard=2"]),
}


@dataclass(frozen=True)
class Run:
    output_dir: Path
    stdout: str

    def metrics(self) -> list[dict]:
        return interval_metrics(self.output_dir)

    def digests(self) -> list[str]:
        """What the loaders delivered, one digest per optimizer update."""
        return [update.digest for update in read_ledger(self.output_dir).updates]

    def weights(self) -> dict[str, torch.Tensor]:
        return last_weights(self.output_dir)


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """``layout_run(name)`` -> the finished run of ``LAYOUT_RUNS[name]`` (trained once per session, on first use,
    by whichever xdist worker needs it first)."""

    def get(name: str) -> Run:
        with shared_by_workers(tmp_path_factory, f"layouts/{name}") as output_dir:
            stdout_file = output_dir.with_suffix(".stdout")
            if not stdout_file.is_file():  # written last: the run finished
                shutil.rmtree(output_dir, ignore_errors=True)
                nproc, overrides = LAYOUT_RUNS[name]
                proc = run_train([*DETERMINISTIC_RUN, *overrides, f"output_dir={output_dir}"], nproc=nproc,
                                 timeout=180, env=OTHER_KERNEL if name.startswith("single") else None)
                stdout_file.write_text(proc.stdout)
            return Run(output_dir, stdout_file.read_text())

    return get
