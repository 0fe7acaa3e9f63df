"""Evaluate a trained policy in the ALOHA transfer-cube simulation on held-out seeds.

    python scripts/eval.py policy_path=outputs/train/<run>/checkpoints/last/pretrained_model n_episodes=50
    python scripts/eval.py --policy_path=<pretrained_model> --video_dir=outputs/eval/videos --out=outputs/eval/report.json
    python scripts/eval.py expert=true n_episodes=50       # the scripted expert, for reference
    lerobot-mg-eval --policy_path=<pretrained_model> --device=cuda
    lerobot-mg-eval --help                                 # every key, its type and default

Needs the sim extra (pip install 'lerobot_mg[sim]'). Prints the success rate (reward 4 reached)
with its count and the mean return.
"""

from lerobot_mg.sim.cli import eval_main

if __name__ == "__main__":
    raise SystemExit(eval_main())
