"""Closed-loop evaluation in the transfer-cube scene: success rate, returns, optional videos.

An episode succeeds when the reward reaches 4 (the left gripper holds the cube off the table) and
ends there, as gym-aloha's environment terminates; otherwise it runs ``max_steps`` steps. Use
held-out seeds (``HELD_OUT_SEED_START`` and up): dataset seeds stay below it.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.peft.lora import load_policy
from lerobot_mg.processors import load_processors
from lerobot_mg.sim.env import (
    EPISODE_LENGTH,
    FPS,
    HELD_OUT_SEED_START,
    IMAGE_KEY,
    MAX_REWARD,
    NUM_JOINTS,
    TASK,
    CameraRenderer,
    SimObservation,
    TransferCubeSim,
)
from lerobot_mg.sim.expert import record_expert_demo

# Video frames are rendered at this size unless the policy itself watches a camera (then its size).
VIDEO_SIZE = (240, 320)
SUPPORTED_INPUTS = ("observation.state", "observation.environment_state", IMAGE_KEY)


@dataclass(frozen=True)
class EpisodeResult:
    seed: int
    success: bool
    sum_reward: int
    max_reward: int
    num_steps: int
    # The sum of every joint position the controller commanded: two rollouts of a seed that agree on it took the
    # same actions (what the per-episode comparison of two evaluations checks, beyond their rewards).
    action_sum: float = 0.0


class Controller(Protocol):
    """Chooses a joint action from an observation dict (keys of ``SUPPORTED_INPUTS``)."""

    image_size: tuple[int, int] | None  # (height, width) of the camera it watches, None for state only

    def reset(self, seed: int) -> None: ...

    def act(self, observation: dict[str, np.ndarray]) -> np.ndarray: ...


class PolicyController:
    """Runs a policy: preprocessor -> ``select_action`` (its own chunk queue) -> postprocessor, in eval mode.

    Each observation goes in with the scene's instruction as its ``task`` (``task``, by default the transfer-cube's
    :data:`TASK`), as LeRobot's environments hand theirs over: the preprocessor of a policy that reads language (pi0,
    pi0.5, SmolVLA) turns it into the prompt's tokens; the others' preprocessors pass it by.

    :meth:`load` reads a saved one. A PEFT checkpoint runs as base + adapter: merged into the weights by default, or
    as the peft model (``merge_adapter=False``), which gives the same actions up to float rounding. Each episode
    starts from torch's global generator seeded with the episode's seed, so a policy that samples (Diffusion) gives
    the same rollout for a seed wherever it runs (training wraps evaluation in a fork of the generators)."""

    def __init__(self, policy: Any, preprocessor: Any, postprocessor: Any, device: str | torch.device = "cpu",
                 source: str = "the policy", task: str = TASK) -> None:
        self.device = torch.device(device)
        self.task = task
        self.policy = policy.to(self.device).eval()
        self.preprocessor, self.postprocessor = preprocessor.to(self.device), postprocessor.to(self.device)
        # What the scene gives the policy: its inputs but the empty cameras (policy.empty_cameras), which it fills.
        read = self.policy.config.data_keys(self.policy.input_features, SUPPORTED_INPUTS)
        self.inputs = {key: self.policy.input_features[key] for key in read}
        self.image_size = check_sim_policy(self.inputs, self.policy.output_features, source)

    @classmethod
    def load(cls, pretrained_dir: Path, device: str = "cpu", merge_adapter: bool = True) -> PolicyController:
        policy = load_policy(pretrained_dir, map_location=str(device), merge_adapter=merge_adapter)
        preprocessor, postprocessor = load_processors(pretrained_dir)
        return cls(policy, preprocessor, postprocessor, device, str(pretrained_dir))

    def reset(self, seed: int) -> None:
        self.policy.reset()
        torch.manual_seed(seed)

    def act(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        batch = {}
        for key in self.inputs:
            value = torch.from_numpy(observation[key]).to(self.device)
            if key == IMAGE_KEY:
                # Datasets decode video frames to float CHW in [0, 1]; the policy was trained on those.
                value = value.permute(2, 0, 1).float() / 255.0
            batch[key] = value.float().unsqueeze(0)
        batch["task"] = [self.task]
        with torch.inference_mode():
            action_BA = self.policy.select_action(self.preprocessor(batch))
            action_BA = self.postprocessor({"action": action_BA})["action"]
        return action_BA[0].cpu().numpy().astype(np.float64)


def check_sim_policy(inputs: dict[str, Any], outputs: dict[str, Any], source: str) -> tuple[int, int] | None:
    """A ConfigError unless the transfer-cube scene provides every input of a policy and takes its actions; the
    (height, width) of the camera it watches (None: state only)."""
    unsupported = sorted(set(inputs) - set(SUPPORTED_INPUTS))
    if unsupported:
        raise ConfigError(
            f"{source}: the policy reads {unsupported}, which the transfer-cube simulation does not "
            f"provide (it provides {list(SUPPORTED_INPUTS)}). Fix: evaluate a policy trained on the embedded "
            "ALOHA dataset (dataset=embedded)"
        )
    action_shape = list(outputs["action"]["shape"])
    if action_shape != [NUM_JOINTS]:
        raise ConfigError(
            f"{source}: the policy outputs actions of shape {action_shape}, but the ALOHA scene takes "
            f"[{NUM_JOINTS}] joint positions. Fix: evaluate a policy trained on the embedded ALOHA dataset "
            "(dataset=embedded)"
        )
    if IMAGE_KEY not in inputs:
        return None
    _, height, width = inputs[IMAGE_KEY]["shape"]
    return int(height), int(width)


class ExpertController:
    """The scripted expert replayed open loop: the reference for what a perfect policy scores."""

    image_size: tuple[int, int] | None = None

    def __init__(self) -> None:
        self._expert_sim = TransferCubeSim(end_effector=True)
        self._joint_actions_TA = np.zeros((0, NUM_JOINTS))
        self._step = 0

    def reset(self, seed: int) -> None:
        self._joint_actions_TA = record_expert_demo(seed, self._expert_sim).joint_actions_TA
        self._step = 0

    def act(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        # Past the demo's end the arms hold their last pose.
        action = self._joint_actions_TA[min(self._step, len(self._joint_actions_TA) - 1)]
        self._step += 1
        return action


def evaluate_policy(
    pretrained_dir: Path,
    n_episodes: int,
    seed_start: int,
    video_dir: Path | None = None,
    max_steps: int = EPISODE_LENGTH,
    device: str = "cpu",
    n_video_episodes: int = 3,
    merge_adapter: bool = True,
    log_every_s: float = 30.0,
) -> dict[str, Any]:
    """Rolls out the policy saved in ``pretrained_dir`` on seeds ``seed_start .. seed_start+n_episodes-1``.

    Returns ``success_rate``, ``num_successes``, ``n_episodes``, ``mean_return``, ``per_episode``
    (seed, success, sum_reward, max_reward, num_steps), ``seconds_per_episode`` and ``videos``
    (mp4 files of the first ``n_video_episodes`` episodes when ``video_dir`` is given). Progress: a bar on a
    terminal, else a plain line every ``log_every_s`` seconds and after the last episode.
    """
    pretrained_dir = Path(pretrained_dir)
    if not pretrained_dir.is_dir():
        raise config_error("policy_path", str(pretrained_dir), "is not a directory",
                           "policy_path=<run>/checkpoints/<step or last>/pretrained_model")
    controller = PolicyController.load(pretrained_dir, device=device, merge_adapter=merge_adapter)
    return run_evaluation(controller, n_episodes, seed_start, video_dir, max_steps, n_video_episodes, log_every_s)


def evaluate_expert(
    n_episodes: int,
    seed_start: int = HELD_OUT_SEED_START,
    video_dir: Path | None = None,
    max_steps: int = EPISODE_LENGTH,
    n_video_episodes: int = 3,
) -> dict[str, Any]:
    """Same report as :func:`evaluate_policy`, for the scripted expert."""
    return run_evaluation(ExpertController(), n_episodes, seed_start, video_dir, max_steps, n_video_episodes)


def run_evaluation(
    controller: Controller,
    n_episodes: int,
    seed_start: int,
    video_dir: Path | None = None,
    max_steps: int = EPISODE_LENGTH,
    n_video_episodes: int = 3,
    log_every_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    if n_episodes < 1:
        raise config_error("n_episodes", n_episodes, "must be >= 1", "n_episodes=50")
    if max_steps < 1:
        raise config_error("max_steps", max_steps, "must be >= 1", f"max_steps={EPISODE_LENGTH}")
    if seed_start < 0:
        raise config_error("seed_start", seed_start, f"must be >= 0 (held-out seeds start at {HELD_OUT_SEED_START})",
                           f"seed_start={HELD_OUT_SEED_START}")
    started = time.perf_counter()
    seeds = list(range(seed_start, seed_start + n_episodes))
    results, videos = rollout_episodes(controller, seeds, seeds[:n_video_episodes], video_dir, max_steps,
                                       EpisodeProgress(n_episodes, log_every_s, clock))
    return summarize(results, seed_start, time.perf_counter() - started, videos)


class RolloutError(RuntimeError):
    """The rollout of one episode raised; ``seed`` names it, the cause is chained."""

    def __init__(self, seed: int, cause: BaseException) -> None:
        super().__init__(f"the rollout of episode seed {seed} failed: {cause!r}")
        self.seed = seed


def rollout_episodes(
    controller: Controller,
    seeds: list[int],
    video_seeds: Sequence[int] = (),
    video_dir: Path | None = None,
    max_steps: int = EPISODE_LENGTH,
    progress: EpisodeProgress | None = None,
) -> tuple[list[EpisodeResult], list[str]]:
    """Roll out one episode per seed, in order; the episodes of ``video_seeds`` are recorded as mp4 files in
    ``video_dir`` (named by their place in ``video_seeds``). Raises :class:`RolloutError` naming the seed of an
    episode that failed."""
    video_seeds = list(video_seeds) if video_dir is not None else []
    sim = TransferCubeSim()
    policy_camera = CameraRenderer(sim, *controller.image_size) if controller.image_size is not None else None
    video_camera: CameraRenderer | None = None
    if set(video_seeds) & set(seeds):
        assert video_dir is not None
        video_camera = policy_camera if policy_camera is not None else CameraRenderer(sim, *VIDEO_SIZE)
        Path(video_dir).mkdir(parents=True, exist_ok=True)
    results: list[EpisodeResult] = []
    videos: list[str] = []
    try:
        for position in progress.episodes() if progress is not None else range(len(seeds)):
            seed = seeds[position]
            record = video_camera is not None and seed in video_seeds
            try:
                result, frames = _rollout(sim, controller, seed, max_steps, policy_camera,
                                          video_camera if record else None)
            except Exception as error:
                raise RolloutError(seed, error) from error
            results.append(result)
            if progress is not None:
                progress.episode_done(result.success)
            if record:
                assert video_dir is not None and frames
                path = Path(video_dir) / f"eval_episode_{video_seeds.index(seed):03d}_seed_{seed}.mp4"
                write_video(path, np.stack(frames))
                videos.append(str(path))
    finally:
        if policy_camera is not None:
            policy_camera.close()
        if video_camera is not None and video_camera is not policy_camera:
            video_camera.close()
    return results, videos


def summarize(results: list[EpisodeResult], seed_start: int, seconds: float, videos: list[str]) -> dict[str, Any]:
    """The report of a set of episodes (in seed order): success rate and count, mean return and length, each
    episode, and the videos."""
    num_successes = sum(result.success for result in results)
    return {
        "success_rate": num_successes / len(results),
        "num_successes": num_successes,
        "n_episodes": len(results),
        "mean_return": float(np.mean([result.sum_reward for result in results])),
        "mean_episode_length": float(np.mean([result.num_steps for result in results])),
        "per_episode": [asdict(result) for result in results],
        "seed_start": seed_start,
        "seconds_per_episode": round(seconds / len(results), 3),
        "videos": videos,
    }


class EpisodeProgress:
    """Evaluation progress on stdout, by the rule of training's: a bar on a terminal; otherwise (a SLURM job's .out
    file, a redirect) one plain line every ``log_every_s`` seconds and after the last episode."""

    def __init__(self, n_episodes: int, log_every_s: float, clock: Callable[[], float],
                 terminal: bool | None = None) -> None:
        self.n_episodes, self.log_every_s, self.clock = n_episodes, log_every_s, clock
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self._start = self._line_time = clock()
        self._done = self._successes = 0

    def episodes(self) -> Iterable[int]:
        if self.terminal:
            return tqdm(range(self.n_episodes), desc="evaluation", unit="episode", file=sys.stdout)
        return range(self.n_episodes)

    def episode_done(self, success: bool) -> None:
        self._done += 1
        self._successes += int(success)
        now = self.clock()
        if not self.terminal and (self._done == self.n_episodes or now - self._line_time >= self.log_every_s):
            per_episode = (now - self._start) / self._done
            eta = timedelta(seconds=round(per_episode * (self.n_episodes - self._done)))
            print(f"evaluation episode {self._done}/{self.n_episodes} | successes {self._successes} | "
                  f"{per_episode:.1f} s/episode | ETA {eta}", flush=True)
            self._line_time = now


def _rollout(
    sim: TransferCubeSim,
    controller: Controller,
    seed: int,
    max_steps: int,
    policy_camera: CameraRenderer | None,
    video_camera: CameraRenderer | None,
) -> tuple[EpisodeResult, list[np.ndarray]]:
    controller.reset(seed)
    observation = sim.reset(seed)
    frames: list[np.ndarray] = []
    sum_reward = max_reward = num_steps = 0
    action_sum = 0.0
    while num_steps < max_steps and max_reward < MAX_REWARD:
        inputs = policy_inputs(observation)
        if policy_camera is not None:
            inputs[IMAGE_KEY] = policy_camera.render()
        if video_camera is not None:
            frames.append(inputs[IMAGE_KEY] if video_camera is policy_camera else video_camera.render())
        action = np.asarray(controller.act(inputs), dtype=np.float64)
        action_sum += float(action.sum())
        observation, reward = sim.step(action)
        sum_reward += reward
        max_reward = max(max_reward, reward)
        num_steps += 1
    if video_camera is not None:
        frames.append(video_camera.render())  # the final state, e.g. the cube in the left gripper
    result = EpisodeResult(
        seed=seed,
        success=max_reward == MAX_REWARD,
        sum_reward=sum_reward,
        max_reward=max_reward,
        num_steps=num_steps,
        action_sum=action_sum,
    )
    return result, frames


def policy_inputs(observation: SimObservation) -> dict[str, np.ndarray]:
    return {
        "observation.state": observation.qpos_14.astype(np.float32),
        "observation.environment_state": observation.cube_pose_7[:3].astype(np.float32),
    }


def write_video(path: Path, frames_THWC: np.ndarray, fps: int = FPS) -> None:
    """Encodes RGB frames as an H.264 mp4."""
    _, height, width, _ = frames_THWC.shape
    # The video module (PyAV) is imported when a video is written: every rank of a training run imports this
    # module for its evaluations, and PyAV adds about 0.3 s to each one's start-up.
    encoder = importlib.import_module("lerobot_mg.data.video").VideoEncoder("eval", Path(path), fps, height, width, "h264")
    encoder.add_frames(frames_THWC)
    encoder.close()
