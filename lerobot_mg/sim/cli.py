"""Command lines of ``lerobot-mg-make-dataset`` and ``lerobot-mg-eval`` (scripts/make_dataset.py, scripts/eval.py).

Exit status: 0 on success, 2 on a user error (the message says what to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lerobot_mg.sim.env import EPISODE_LENGTH


def make_dataset_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lerobot-mg-make-dataset",
        description="Generate scripted ALOHA transfer-cube demonstrations as a LeRobot v3.0 dataset "
        "(reused when --root already holds a complete one made with the same arguments).",
    )
    parser.add_argument("--root", type=Path, required=True, help="dataset directory (created)")
    parser.add_argument("--num_episodes", type=int, default=50, help="successful demos to keep")
    parser.add_argument("--seed_start", type=int, default=0, help="seed of the first episode")
    parser.add_argument(
        "--image_size",
        type=int,
        nargs=2,
        metavar=("HEIGHT", "WIDTH"),
        help="also record the top camera as observation.images.top at this size (e.g. 240 320)",
    )
    parser.add_argument("--video_codec", choices=("h264", "av1"), default="h264")
    args = parser.parse_args(argv)

    from lerobot_mg.sim.generate import generate_dataset

    try:
        report = generate_dataset(
            args.root,
            num_episodes=args.num_episodes,
            seed_start=args.seed_start,
            image_size=tuple(args.image_size) if args.image_size else None,
            video_codec=args.video_codec,
        )
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    state = "reused" if report["reused"] else f"generated in {report['seconds']:.1f} s"
    print(
        f"{args.root}: {report['num_episodes']} episodes, {report['num_frames']} frames ({state}); "
        f"{report['num_discarded']} failed demos discarded (seeds {report['discarded_seeds']})."
    )
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    from lerobot_mg.sim.generate import HELD_OUT_SEED_START

    parser = argparse.ArgumentParser(
        prog="lerobot-mg-eval",
        description="Roll a policy out in the ALOHA transfer-cube simulation on held-out seeds and report "
        "its success rate (reward 4 reached) and mean return.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--policy_path", type=Path, help="a checkpoint's pretrained_model directory")
    source.add_argument(
        "--expert", action="store_true", help="evaluate the scripted expert instead (reference)"
    )
    parser.add_argument("--n_episodes", type=int, default=50)
    parser.add_argument(
        "--seed_start",
        type=int,
        default=HELD_OUT_SEED_START,
        help=f"first seed; dataset seeds stay below {HELD_OUT_SEED_START}",
    )
    parser.add_argument("--max_steps", type=int, default=EPISODE_LENGTH)
    parser.add_argument("--device", default="cpu", help="torch device of the policy, e.g. cuda")
    parser.add_argument(
        "--video_dir", type=Path, help="write mp4s of the first --n_video_episodes episodes here"
    )
    parser.add_argument("--n_video_episodes", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the full report (per-episode results) as JSON here")
    parser.add_argument(
        "--keep_adapter", action="store_true",
        help="a PEFT checkpoint: run base + adapter as the peft model instead of merging the adapter into the weights",
    )
    args = parser.parse_args(argv)

    from lerobot_mg.sim.evaluate import evaluate_expert, evaluate_policy

    try:
        if args.expert:
            report = evaluate_expert(
                args.n_episodes, args.seed_start, args.video_dir, args.max_steps, args.n_video_episodes
            )
        else:
            report = evaluate_policy(
                args.policy_path,
                args.n_episodes,
                args.seed_start,
                video_dir=args.video_dir,
                max_steps=args.max_steps,
                device=args.device,
                n_video_episodes=args.n_video_episodes,
                merge_adapter=not args.keep_adapter,
            )
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"success {report['num_successes']}/{report['n_episodes']} ({100 * report['success_rate']:.1f}%), "
        f"mean return {report['mean_return']:.1f}, seeds {args.seed_start}..{args.seed_start + args.n_episodes - 1}, "
        f"{report['seconds_per_episode']:.2f} s/episode"
    )
    for video in report["videos"]:
        print(f"video: {video}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0
