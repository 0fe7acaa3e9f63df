"""Print the memory plan of a full-size VLA for the layouts it is sharded on, as the Markdown table of
docs/sharding.md: per rank (the busiest) in GiB, fp32 weights with and without bf16 mixed precision.

    python scripts/plan_table.py                  # pi0 (pi05, smolvla also work)
    python scripts/plan_table.py pi05 --batch-size 4 --accumulation 4

The policy is LeRobot's full-size network built on the meta device (no memory, no weights, no download), with a
LIBERO-shaped input (two 256x256 cameras, 8-d state, 7-d action); the numbers are what ``plan=true
plan_world_size=N`` prints for the same layout and keys.
"""

from __future__ import annotations

import argparse

import torch

from lerobot_mg.config.schema import POLICY_CONFIGS, TrainConfig
from lerobot_mg.distributed.memory import plan_memory, plan_table
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.policies import make_policy

LAYOUTS = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (2, 8)]  # (dp_replicate, dp_shard)
LIBERO_FEATURES = {
    "observation.images.image": {"dtype": "video", "shape": [256, 256, 3]},
    "observation.images.wrist_image": {"dtype": "video", "shape": [256, 256, 3]},
    "observation.state": {"dtype": "float32", "shape": [8]},
    "action": {"dtype": "float32", "shape": [7]},
}


def _label(dp_replicate: int, dp_shard: int) -> str:
    if dp_replicate * dp_shard == 1:
        return "1 process"
    return f"FSDP-{dp_shard}" if dp_replicate == 1 else f"HSDP {dp_replicate}x{dp_shard}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", nargs="?", default="pi0", choices=sorted(set(POLICY_CONFIGS) - {"act", "diffusion"}))
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4)
    args = parser.parse_args()
    with torch.device("meta"):
        policy = make_policy(POLICY_CONFIGS[args.policy](), LIBERO_FEATURES)
    rows = []
    for precision, words in (("no", "fp32"), ("bf16", "bf16")):
        for dp_replicate, dp_shard in LAYOUTS:
            cfg = TrainConfig()
            cfg.batch_size = args.batch_size
            cfg.accelerator.mixed_precision = precision
            cfg.accelerator.gradient_accumulation.steps = args.accumulation
            cfg.eval.n_episodes = 10
            world = dp_replicate * dp_shard
            dims = ParallelDims.resolve(dp_replicate, dp_shard, world, launched=world > 1)
            rows.append((f"{_label(dp_replicate, dp_shard)} {words}", plan_memory(cfg, dims, policy)))
    print(f"{args.policy}: {sum(p.numel() for p in policy.parameters()):,} parameters, batch_size "
          f"{args.batch_size}, accumulation {args.accumulation}, evaluation on")
    print("\n".join(plan_table(rows)))


if __name__ == "__main__":
    main()
