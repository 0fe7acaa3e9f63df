"""Benchmark: our ACT training step against LeRobot 0.6.1's, side by side in one process, on one thread.

    LEROBOT_PEER_SITE_PACKAGES=<venv with lerobot 0.6.1>/lib/python3.11/site-packages \\
        python scripts/bench_lerobot_act.py          # outputs/bench/bench_lerobot_act.json

Both policies are built from the same config with the same weights (LeRobot's init, loaded strictly into ours),
and run the same training step (forward, backward, AdamW step) on the same random normalized batch of 8, the
two alternating step by step so that load on the machine hits both alike; the figure is the ratio of the median
step times, ours / LeRobot's:

- image: aloha_image's ACT (dim_model 256, 4 + 1 layers, feed-forward 1024, chunk 50, VAE) with LeRobot's
  ResNet18 (frozen batch norm) on one 96x96 camera, state and environment state of 14. Goal <= 1.0.
- state: aloha_state's ACT (dim_model 256, feed-forward 512, no VAE), state and environment state. Goal <= 1.05.

Also the largest difference of the eval-mode losses and action chunks (same weights, same batch; goal <= 1e-5).
LeRobot is not a dependency: where it cannot be imported (LEROBOT_PEER_SITE_PACKAGES unset, e.g. under `make
bench`), the script prints one line saying so and exits 0. That directory goes first on sys.path (LeRobot needs
its own PyAV); lerobot_mg's own dependencies are found after it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

STATE_DIM = ENV_DIM = ACTION_DIM = 14
BATCH_SIZE = 8
TRANSFORMER = {"chunk_size": 50, "n_action_steps": 50, "dim_model": 256, "n_heads": 8, "n_encoder_layers": 4,
               "n_decoder_layers": 1}
CASES: dict[str, tuple[dict[str, Any], bool, float]] = {  # name -> (ACT fields, camera, goal)
    "image": ({**TRANSFORMER, "dim_feedforward": 1024, "use_vae": True}, True, 1.0),
    "state": ({**TRANSFORMER, "dim_feedforward": 512, "use_vae": False}, False, 1.05),
}
CAMERA = "observation.images.top"
AGREEMENT_GOAL = 1e-5


def import_lerobot() -> Any | None:
    site_packages = os.environ.get("LEROBOT_PEER_SITE_PACKAGES")
    if site_packages:
        sys.path.insert(0, site_packages)
    try:
        from lerobot.policies.act import modeling_act
    except ImportError:
        return None
    return modeling_act


def features(camera: bool, image_size: int) -> tuple[dict[str, dict], dict[str, dict]]:
    inputs = {"observation.state": {"type": "STATE", "shape": [STATE_DIM]},
              "observation.environment_state": {"type": "ENV", "shape": [ENV_DIM]}}
    if camera:
        inputs[CAMERA] = {"type": "VISUAL", "shape": [3, image_size, image_size]}
    return inputs, {"action": {"type": "ACTION", "shape": [ACTION_DIM]}}


def lerobot_policy(lerobot_act: Any, fields: dict[str, Any], inputs: dict, outputs: dict) -> torch.nn.Module:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.act.configuration_act import ACTConfig as LeRobotACTConfig

    def policy_features(specs: dict) -> dict:
        return {key: PolicyFeature(type=FeatureType[spec["type"]], shape=tuple(spec["shape"]))
                for key, spec in specs.items()}

    config = LeRobotACTConfig(input_features=policy_features(inputs), output_features=policy_features(outputs),
                              pretrained_backbone_weights=None, device="cpu", push_to_hub=False, **fields)
    return lerobot_act.ACTPolicy(config)


def random_batch(inputs: dict, chunk_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    batch = {key: torch.randn(BATCH_SIZE, *spec["shape"], generator=generator) for key, spec in inputs.items()}
    batch["action"] = torch.randn(BATCH_SIZE, chunk_size, ACTION_DIM, generator=generator)
    pad = torch.zeros(BATCH_SIZE, chunk_size, dtype=torch.bool)
    pad[: BATCH_SIZE // 4, chunk_size - chunk_size // 5 :] = True  # a quarter of the samples end early
    batch["action_is_pad"] = pad
    return batch


def timed_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    loss, _ = policy(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def agreement(ours: torch.nn.Module, theirs: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Largest |difference| of the eval-mode loss and action chunk (same weights, same batch)."""
    ours.eval()
    theirs.eval()
    observation = {key: value for key, value in batch.items() if not key.startswith("action")}
    with torch.no_grad():
        loss_diff = (ours(batch)[0] - theirs(batch)[0]).abs().item()
        chunk_diff = (ours.predict_action_chunk(observation) - theirs.predict_action_chunk(observation)).abs().max()
    ours.train()
    theirs.train()
    return max(loss_diff, chunk_diff.item())


def bench_case(lerobot_act: Any, name: str, rounds: int, image_size: int) -> list:
    from benchmarking import BenchResult

    from lerobot_mg.policies.act import ACTConfig, ACTPolicy

    fields, camera, goal = CASES[name]
    inputs, outputs = features(camera, image_size)
    torch.manual_seed(0)
    theirs = lerobot_policy(lerobot_act, fields, inputs, outputs)
    ours = ACTPolicy(ACTConfig(**fields), inputs, outputs, load_backbone_weights=False)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    batch = random_batch(inputs, fields["chunk_size"])
    max_diff = agreement(ours, theirs, batch)

    optimizers = {id(policy): torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5,
                                                weight_decay=1e-4) for policy in (ours, theirs)}
    times: dict[str, list[float]] = {"ours": [], "lerobot": []}
    for index in range(rounds + 2):  # the first two rounds warm up
        for label, policy in (("ours", ours), ("lerobot", theirs)) if index % 2 else (("lerobot", theirs),
                                                                                      ("ours", ours)):
            elapsed = timed_step(policy, optimizers[id(policy)], batch)
            if index >= 2:
                times[label].append(elapsed)
    ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["lerobot"])
    print(f"{name}: ours {ours_s * 1e3:.1f} ms, LeRobot {theirs_s * 1e3:.1f} ms per step (median of {rounds})",
          flush=True)
    return [
        BenchResult(f"act_{name}_step_ours_over_lerobot", ours_s / theirs_s, goal, "x"),
        BenchResult(f"act_{name}_step_ms_ours", ours_s * 1e3, None, "ms"),
        BenchResult(f"act_{name}_step_ms_lerobot", theirs_s * 1e3, None, "ms"),
        BenchResult(f"act_{name}_eval_max_abs_diff", max_diff, AGREEMENT_GOAL, ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per policy and case")
    parser.add_argument("--image-size", type=int, default=96, help="camera height and width")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    lerobot_act = import_lerobot()
    if lerobot_act is None:
        print("bench_lerobot_act: lerobot 0.6.1 is not importable (set LEROBOT_PEER_SITE_PACKAGES to its "
              "site-packages); nothing measured")
        return
    from benchmarking import report

    torch.set_num_threads(1)
    results = [result for name in args.cases for result in bench_case(lerobot_act, name, args.rounds,
                                                                        args.image_size)]
    report("bench_lerobot_act", results)


if __name__ == "__main__":
    main()
