"""Generate the embedded dataset: scripted ALOHA transfer-cube demos as a LeRobot v3.0 dataset.

    python scripts/make_dataset.py root=outputs/datasets/aloha_transfer_cube num_episodes=50
    python scripts/make_dataset.py --root=outputs/datasets/aloha_cube_images --num_episodes=50 --image_size=[240,320]
    lerobot-mg-make-dataset root=outputs/datasets/aloha_transfer_cube num_episodes=50 video_codec=av1
    lerobot-mg-make-dataset --help                     # every key, its type and default

Needs the sim extra (pip install 'lerobot_mg[sim]'). A root that already holds a complete dataset
made with the same arguments is reused; an interrupted one is regenerated.
"""

from lerobot_mg.sim.cli import make_dataset_main

if __name__ == "__main__":
    raise SystemExit(make_dataset_main())
