"""ALOHA transfer-cube in simulation: the scripted expert, the embedded dataset, evaluation rollouts.

Needs the optional ``sim`` extra (mujoco, dm_control, gym-aloha). Importing this package does not:
the simulator is imported inside the functions, which raise an ImportError naming the install
command when it is missing. Nothing outside ``lerobot_mg/sim`` and ``scripts/`` imports it.
"""

from lerobot_mg.sim.backend import SIM_INSTALL_HINT, require_sim
from lerobot_mg.sim.evaluate import evaluate_expert, evaluate_policy
from lerobot_mg.sim.generate import COMPLETE_MARKER, HELD_OUT_SEED_START, generate_dataset

__all__ = [
    "COMPLETE_MARKER",
    "HELD_OUT_SEED_START",
    "SIM_INSTALL_HINT",
    "evaluate_expert",
    "evaluate_policy",
    "generate_dataset",
    "require_sim",
]
