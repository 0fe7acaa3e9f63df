"""Train a policy: one process, DDP, FSDP2 or HSDP, from the same command line.

    python scripts/train.py                                                    # 1 process (CPU or 1 GPU)
    torchrun --nproc-per-node=2 scripts/train.py                               # DDP
    torchrun --nproc-per-node=2 scripts/train.py parallelism.dp_shard=2 accelerator.mixed_precision=bf16
    torchrun --nproc-per-node=4 scripts/train.py parallelism.dp_replicate=2 parallelism.dp_shard=2
    accelerate launch --num_processes=2 scripts/train.py parallelism.dp_shard=-1
    python scripts/train.py resume=true config_path=outputs/train/.../checkpoints/last/pretrained_model/train_config.json
    python scripts/train.py --steps=100 --batch_size=16                        # LeRobot's --key=value spelling
    python scripts/train.py -m optimizer.lr=1e-4,3e-4 seed=1,2                 # local sweep: 4 runs in a row
    python scripts/train.py -m hydra/launcher=slurm hydra.launcher.nodes=2 hydra.launcher.gpus_per_node=8 \
        parallelism.dp_replicate=2 parallelism.dp_shard=8 optimizer.lr=1e-4,3e-4   # 2 SLURM jobs x 16 ranks

The same entry point is installed as `lerobot-mg-train`. Hydra composes conf/train.yaml; every override is
validated before any process group starts.
"""

from lerobot_mg.scripts_entry import train

if __name__ == "__main__":
    train()
