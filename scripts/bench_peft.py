"""Benchmark: what LoRA saves over full fine-tuning of the same base, on disk and per rank, under FSDP-2.

    python scripts/bench_peft.py                       # CPU, gloo: ACT with dim_model 256 on the PushT slice
    python scripts/bench_peft.py --dim-model 512 --r 16

Three real runs of scripts/train.py (torchrun, 2 processes, FSDP-2): a base (2 steps from scratch), then from that
base a full fine-tuning run and a LoRA run (peft.r, the policy's default targets), 2 steps each. Measured:

1. Checkpoint size: adapter_model.safetensors / model.safetensors of the same step. Goal <= 0.10.
2. Training state per rank (parameter shards + gradients + optimizer state, from rank_bytes.json at the end of the
   run): LoRA FSDP-2 / full FSDP-2. Goal <= 0.35 (the frozen base shard stays; its gradients and AdamW moments go).
3. Parameter bytes per rank of the LoRA FSDP-2 run / the whole model's: each rank holds its shard of the frozen
   base. Goal <= 0.55 (limit 0.5 plus the adapters).

Printed with the goal beside each figure (scripts/benchmarking.py) and written to outputs/bench/bench_peft.json as a
list of {name, value, goal, unit, goal_is}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarking import BenchResult, report

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO / "lerobot_mg" / "data" / "pusht_image_slice"  # a real LeRobot v3.0 dataset (package data)
LAST = Path("checkpoints") / "last" / "pretrained_model"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(output_dir: Path, overrides: list[str], nproc: int = 2) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={_port()}", str(REPO / "scripts" / "train.py"),
           "experiment=pusht_debug", f"dataset.root={DATASET}", "logging.progress_bar=false", "steps=2",
           "batch_size=4", "log_freq=1", "parallelism.dp_shard=2", f"output_dir={output_dir}", *overrides]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")


def _rank_bytes(run: Path) -> list[dict[str, int]]:
    return json.loads((run / "rank_bytes.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim-model", type=int, default=256)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=None,
                        help="keep the runs under this directory (default: a temporary directory, removed)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_peft_", dir=args.dir))
    size = [f"policy.dim_model={args.dim_model}", f"policy.dim_feedforward={4 * args.dim_model}",
            "policy.n_heads=8", "policy.n_encoder_layers=4", "policy.n_vae_encoder_layers=4"]
    _train(root / "base", size)
    base = root / "base" / LAST
    _train(root / "full", [f"policy.path={base}"])
    _train(root / "lora", [f"policy.path={base}", "peft=lora", f"peft.r={args.r}"])

    full_bytes = (root / "full" / LAST / "model.safetensors").stat().st_size
    adapter_bytes = (root / "lora" / LAST / "adapter_model.safetensors").stat().st_size
    full_held = max(held["total"] for held in _rank_bytes(root / "full"))
    lora_held = max(held["total"] for held in _rank_bytes(root / "lora"))
    lora_params = max(held["parameters"] for held in _rank_bytes(root / "lora"))
    whole_params = sum(held["parameters"] for held in _rank_bytes(root / "full"))  # the shards add up to the model
    print(f"ACT dim_model {args.dim_model}, LoRA r={args.r} on the policy's default targets; runs in {root}")
    print(f"adapter checkpoint {adapter_bytes / 2**20:.3f} MiB, full checkpoint {full_bytes / 2**20:.2f} MiB; "
          f"training state per rank (max over ranks) LoRA {lora_held / 2**20:.2f} MiB, full {full_held / 2**20:.2f} "
          f"MiB; parameters per rank LoRA {lora_params / 2**20:.2f} MiB, whole model {whole_params / 2**20:.2f} MiB")
    report("bench_peft", [
        BenchResult("adapter_checkpoint_over_full_checkpoint", adapter_bytes / full_bytes, 0.10, "ratio"),
        BenchResult("lora_fsdp2_training_state_per_rank_over_full_fsdp2", lora_held / full_held, 0.35, "ratio"),
        BenchResult("lora_fsdp2_parameters_per_rank_over_whole_model", lora_params / whole_params, 0.55, "ratio"),
    ])
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
