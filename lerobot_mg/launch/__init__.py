"""How a run is launched: the run directory every rank agrees on (run_dir), one point of a Hydra sweep (sweep),
a SLURM task's torch.distributed variables (slurm_env), the SLURM sweep launcher (submitit_launcher, plugins/),
preemption and requeue (preemption), where the ranks landed (placement), and what one train() call leaves behind
(run_state)."""
