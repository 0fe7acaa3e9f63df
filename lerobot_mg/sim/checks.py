"""Start-up checks of a training run that evaluates in simulation (``eval.n_episodes > 0``), called by
:mod:`lerobot_mg.preflight` before any process group: the `sim` extra is installed, and the policy the dataset
trains is one the transfer-cube scene can run (it provides every input the policy reads and takes its actions)."""

from __future__ import annotations

from typing import Any

from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import features_from_dataset
from lerobot_mg.sim.backend import SIM_INSTALL_HINT, missing_sim_packages
from lerobot_mg.sim.env import NUM_JOINTS
from lerobot_mg.sim.evaluate import SUPPORTED_INPUTS

# The observations the scene provides, with their shapes (the camera: any size, rendered at the policy's).
SCENE_SHAPES = {"observation.state": [NUM_JOINTS], "observation.environment_state": [3]}
_FIX = "eval.n_episodes=0 (dataset.val_episodes evaluates without a simulator), or dataset=embedded"


def check_sim_evaluation(cfg: TrainConfig, dataset_features: dict[str, dict[str, Any]]) -> None:
    """A ConfigError when ``eval.n_episodes > 0`` cannot run: no `sim` extra, or no transfer-cube task for the
    dataset's policy."""
    n = cfg.eval.n_episodes
    if n == 0:
        return
    missing = missing_sim_packages()
    if missing:
        raise config_error("eval.n_episodes", n, f"evaluation in simulation needs the sim extra, and {missing} "
                           "are not installed", f"{SIM_INSTALL_HINT}, or {_FIX}")
    inputs, outputs = features_from_dataset(dataset_features, cfg.policy.observation_keys)
    unsupported = sorted(set(inputs) - set(SUPPORTED_INPUTS))
    if unsupported:
        raise config_error("eval.n_episodes", n, f"evaluation runs the ALOHA transfer-cube simulation, which does not "
                           f"provide {unsupported} that the policy reads from dataset.root (it provides "
                           f"{list(SUPPORTED_INPUTS)})", _FIX)
    for key, shape in SCENE_SHAPES.items():
        if key in inputs and list(inputs[key]["shape"]) != shape:
            raise config_error("eval.n_episodes", n, f"evaluation runs the ALOHA transfer-cube simulation, whose "
                               f"{key} has shape {shape}, and that of dataset.root has shape "
                               f"{list(inputs[key]['shape'])}", _FIX)
    action_shape = list(outputs["action"]["shape"])
    if action_shape != [NUM_JOINTS]:
        raise config_error("eval.n_episodes", n, f"evaluation runs the ALOHA transfer-cube simulation, which takes "
                           f"[{NUM_JOINTS}] joint positions, and the actions of dataset.root have shape {action_shape}",
                           _FIX)
