"""Command lines of ``lerobot-mg-make-dataset`` and ``lerobot-mg-eval`` (scripts/make_dataset.py, scripts/eval.py).

Both take ``key=value`` or ``--key=value`` (lerobot_mg/cli.py). Exit status: 0 on success, 2 on a user error (the
message says what to change).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lerobot_mg import cli
from lerobot_mg.checkpoint.layout import weights_dir
from lerobot_mg.errors import ConfigError
from lerobot_mg.sim.env import EPISODE_LENGTH, HELD_OUT_SEED_START
from lerobot_mg.sim.evaluate import evaluate_expert, evaluate_policy
from lerobot_mg.sim.generate import generate_dataset


@dataclass(frozen=True)
class MakeDatasetArgs:
    """Generate scripted ALOHA transfer-cube demonstrations as a LeRobot v3.0 dataset (reused when root already
    holds a complete one made with the same arguments)."""

    root: Path = field(metadata={"help": "dataset directory (created)"})
    num_episodes: int = field(default=50, metadata={"help": "successful demos to keep"})
    seed_start: int = field(default=0, metadata={"help": "seed of the first episode"})
    image_size: list[int] | None = field(default=None, metadata={
        "help": "[height,width]: also record the top camera as observation.images.top (e.g. [240,320])"})
    video_codec: str = field(default="h264", metadata={"choices": ("h264", "av1")})


def _make_dataset(args: MakeDatasetArgs) -> None:
    try:
        image_size = (args.image_size[0], args.image_size[1]) if args.image_size else None
        report = generate_dataset(args.root, num_episodes=args.num_episodes, seed_start=args.seed_start,
                                  image_size=image_size, video_codec=args.video_codec)
    except ImportError as error:  # the sim extra is missing: its message names the install command
        raise ConfigError(str(error)) from error
    state = "reused" if report["reused"] else f"generated in {report['seconds']:.1f} s"
    print(f"{args.root}: {report['num_episodes']} episodes, {report['num_frames']} frames ({state}); "
          f"{report['num_discarded']} failed demos discarded (seeds {report['discarded_seeds']}).")


@dataclass(frozen=True)
class EvalArgs:
    """Roll a policy out in the ALOHA transfer-cube simulation on held-out seeds and report its success rate
    (reward 4 reached) and mean return."""

    policy_path: Path | None = field(default=None, metadata={"help": "a checkpoint's pretrained_model directory"})
    expert: bool = field(default=False, metadata={"help": "evaluate the scripted expert instead (reference)"})
    n_episodes: int = 50
    seed_start: int = field(default=HELD_OUT_SEED_START, metadata={
        "help": f"first seed; dataset seeds stay below {HELD_OUT_SEED_START}"})
    max_steps: int = EPISODE_LENGTH
    device: str = field(default="cpu", metadata={"help": "torch device of the policy, e.g. cuda"})
    video_dir: Path | None = field(default=None, metadata={"help": "write mp4s of the first n_video_episodes here"})
    n_video_episodes: int = 3
    out: Path | None = field(default=None, metadata={"help": "write the full report (per episode) as JSON here"})
    use_ema: bool = field(default=True, metadata={
        "help": "a checkpoint with pretrained_model_ema/ beside policy_path: roll out its EMA weights (false: "
                "policy_path's own)"})
    keep_adapter: bool = field(default=False, metadata={
        "help": "a PEFT checkpoint: run base + adapter as the peft model instead of merging the adapter in"})

    def __post_init__(self) -> None:
        if (self.policy_path is None) == (not self.expert):
            policy_path = None if self.policy_path is None else str(self.policy_path)
            raise ConfigError(f"policy_path={policy_path!r} expert={self.expert!r}: give exactly one of "
                              "policy_path=<pretrained_model directory> and expert=true. Fix: "
                              "policy_path=<pretrained_model directory>, or expert=true without policy_path")


def _eval(args: EvalArgs) -> None:
    try:
        if args.policy_path is None:
            report = evaluate_expert(args.n_episodes, args.seed_start, args.video_dir, args.max_steps,
                                     args.n_video_episodes)
        else:
            weights = weights_dir(args.policy_path, args.use_ema)
            print(f"evaluating {weights}", flush=True)
            report = evaluate_policy(weights, args.n_episodes, args.seed_start, video_dir=args.video_dir,
                                     max_steps=args.max_steps, device=args.device,
                                     n_video_episodes=args.n_video_episodes, merge_adapter=not args.keep_adapter)
    except ImportError as error:  # the sim extra is missing: its message names the install command
        raise ConfigError(str(error)) from error
    print(f"success {report['num_successes']}/{report['n_episodes']} ({100 * report['success_rate']:.1f}%), "
          f"mean return {report['mean_return']:.1f}, seeds {args.seed_start}..{args.seed_start + args.n_episodes - 1}, "
          f"{report['seconds_per_episode']:.2f} s/episode")
    for video in report["videos"]:
        print(f"video: {video}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def make_dataset_main(argv: list[str] | None = None) -> int:
    return cli.run(MakeDatasetArgs, _make_dataset, "lerobot-mg-make-dataset", argv=argv)


def eval_main(argv: list[str] | None = None) -> int:
    return cli.run(EvalArgs, _eval, "lerobot-mg-eval", argv=argv)
