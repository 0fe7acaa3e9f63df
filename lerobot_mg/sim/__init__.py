"""ALOHA transfer-cube in simulation: the scripted expert, the embedded dataset, evaluation rollouts.

Needs the optional ``sim`` extra (mujoco, dm_control, gym-aloha). Importing this package does not:
the simulator is imported inside the functions, which raise an ImportError naming the install
command when it is missing. Nothing outside ``lerobot_mg/sim`` and ``scripts/`` imports it. The dataset
generator is imported from its module, ``lerobot_mg.sim.generate`` (it writes datasets, which training never does).
"""

from lerobot_mg.sim.backend import SIM_INSTALL_HINT, require_sim
from lerobot_mg.sim.env import HELD_OUT_SEED_START
from lerobot_mg.sim.evaluate import evaluate_expert, evaluate_policy

__all__ = [
    "HELD_OUT_SEED_START",
    "SIM_INSTALL_HINT",
    "evaluate_expert",
    "evaluate_policy",
    "require_sim",
]
