"""scripts/train.py whose simulator crashes on rank 1, for tests/sim/test_eval_during_training.py: the rollout of
episode seed 100001 raises there, as a simulator bug or a broken asset would."""

import os

from lerobot_mg.scripts_entry import train
from lerobot_mg.sim import evaluate

_rollout = evaluate._rollout


def _crashing_rollout(sim, controller, seed, *args):
    if os.environ.get("RANK") == "1" and seed == 100_001:
        raise RuntimeError("eval crash probe: the simulator failed")
    return _rollout(sim, controller, seed, *args)


evaluate._rollout = _crashing_rollout

if __name__ == "__main__":
    train()
