"""Benchmark: our pi0, pi0.5 and SmolVLA training step against LeRobot 0.6.1's own policies, on identical weights and
batch, one thread.

    LEROBOT_PEER_SITE_PACKAGES=<venv with lerobot 0.6.1>/lib/python3.11/site-packages \\
        python scripts/bench_vla_step.py             # outputs/bench/bench_vla_step.json
    ... python scripts/bench_vla_step.py --cases smolvla_full --rounds 3

Cases: ``pi0_tiny``, ``pi05_tiny``, ``smolvla_tiny`` (the LeRobot-written checkpoints and processed batch of
tests/fixtures/lerobot_0_6_1, batch 2) and ``smolvla_full`` (SmolVLA at full size, 450,046,176 parameters, LeRobot's
random initialisation in float32, one 512x512 camera, a prompt of 48 token ids, batch 2; LeRobot builds its
architecture from a local folder holding SmolVLM2-500M's config as lerobot_mg knows it, so nothing is downloaded).

LeRobot runs in a process of its own on its own packages (``LEROBOT_PEER_SITE_PACKAGES`` first on its
``PYTHONPATH``): it builds or loads its policy and writes the weights, which ours loads strictly. Then the two
processes take turns, one training step each (forward with the policy's own noise and time draws, backward, AdamW
step on the trainable parameters, gradients cleared), alternating which goes first, so that load on the machine hits
both alike; the other waits meanwhile. The figure is the ratio of the median step times, ours / LeRobot's; goal
<= 0.9. Where LeRobot cannot be imported (``LEROBOT_PEER_SITE_PACKAGES`` unset, e.g. under `make bench`), the
script prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "lerobot_0_6_1"
CASES = ("pi0_tiny", "pi05_tiny", "smolvla_tiny", "smolvla_full")
GOAL = 0.9
FULL_BATCH = 2
FULL_FEATURES = {"observation.state": [14], "observation.images.top": [3, 512, 512], "action": [14]}
LR = 1e-4


# --- both sides ------------------------------------------------------------------------------------------------------

def trainable(policy: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]


def timed_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    loss, _ = policy(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def load_batch(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def fixture_batch(case: str) -> dict[str, torch.Tensor]:
    """LeRobot's processed batch of the fixture: its preprocessor's output, the padding mask and the cameras in
    [0, 1]."""
    from safetensors.torch import load_file

    reference = load_file(str(FIXTURES / case / "reference.safetensors"))
    batch = {key.removeprefix("pre."): value for key, value in reference.items() if key.startswith("pre.")}
    batch["action_is_pad"] = reference["input.action_is_pad"]
    for key, value in reference.items():
        if key.startswith("input.observation.images.") and key.endswith(".uint8"):
            batch[key.removeprefix("input.").removesuffix(".uint8")] = value.float() / 255
    return batch


def full_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "observation.state": torch.randn(FULL_BATCH, *FULL_FEATURES["observation.state"], generator=generator),
        "observation.images.top": torch.rand(FULL_BATCH, *FULL_FEATURES["observation.images.top"],
                                             generator=generator),
        "observation.language.tokens": torch.randint(0, vocab_size, (FULL_BATCH, 48), generator=generator),
        "observation.language.attention_mask": torch.ones(FULL_BATCH, 48, dtype=torch.bool),
        "action": torch.randn(FULL_BATCH, 50, *FULL_FEATURES["action"], generator=generator),
        "action_is_pad": torch.zeros(FULL_BATCH, 50, dtype=torch.bool),
    }


# --- LeRobot's side (run as `bench_vla_step.py --lerobot-worker CASE WORKDIR` on LeRobot's packages) ----------------

def lerobot_policy(case: str, workdir: Path) -> torch.nn.Module:
    os.chdir(FIXTURES)  # the fixtures' tokenizer and VLM paths are relative to their folder
    if case == "smolvla_full":
        from lerobot.configs.types import FeatureType, PolicyFeature
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

        kinds = {"observation.state": FeatureType.STATE, "observation.images.top": FeatureType.VISUAL}
        config = SmolVLAConfig(
            input_features={key: PolicyFeature(type=kind, shape=tuple(FULL_FEATURES[key]))
                            for key, kind in kinds.items()},
            output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=tuple(FULL_FEATURES["action"]))},
            vlm_model_name=str(workdir / "vlm"), load_vlm_weights=False, device="cpu", push_to_hub=False)
        torch.manual_seed(0)
        return SmolVLAPolicy(config)
    if case == "smolvla_tiny":
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

        return SmolVLAPolicy.from_pretrained(f"{case}/pretrained_model", strict=True)
    sys.path.insert(0, str(FIXTURES))
    from regenerate_vla import tiny_patches  # LeRobot's pi0 sizes come from module-level names it swaps

    overrides = json.loads((FIXTURES / case / "reference.json").read_text())["tiny_overrides"]
    if case == "pi0_tiny":
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
    else:
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
    with tiny_patches(overrides):
        return Policy.from_pretrained(f"{case}/pretrained_model", strict=True)


def lerobot_worker(case: str, workdir: Path) -> None:
    """Build LeRobot's policy, write its weights, then answer one training step per line read on stdin."""
    from safetensors.torch import save_file

    out = os.fdopen(os.dup(1), "w")  # the answers; what LeRobot prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    policy = lerobot_policy(case, workdir)
    policy.train()
    save_file({key: value.contiguous() for key, value in policy.state_dict().items()}, str(workdir / "weights.safetensors"))
    optimizer = torch.optim.AdamW(trainable(policy), lr=LR)
    out.write(json.dumps({"ready": True, "torch": torch.__version__}) + "\n")
    out.flush()
    batch = load_batch(workdir / "batch.safetensors")
    for line in sys.stdin:
        if line.strip() != "step":
            break
        out.write(json.dumps({"seconds": timed_step(policy, optimizer, batch)}) + "\n")
        out.flush()


# --- our side ---------------------------------------------------------------------------------------------------------

def write_full_vlm(directory: Path) -> int:
    """A folder LeRobot builds full-size SmolVLM2-500M from: its config (lerobot_mg's, in code) and, for the
    processor LeRobot always builds, the tiny fixture's tokenizer and processor files (the batch holds token ids)."""
    from lerobot_mg.config.smolvla import SmolVLAConfig
    from lerobot_mg.policies.smolvla.vlm import smolvlm_config

    config = smolvlm_config(SmolVLAConfig())
    config.save_pretrained(directory)
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "smolvla_tiny" / "tiny_vlm" / name, directory / name)
    return int(config.text_config.vocab_size)


def with_dimension_overrides(case: str, copy: Path) -> Path:
    """A copy of pi0_tiny's / pi05_tiny's pretrained_model/ whose train_config.json gives lerobot_mg the tiny sizes
    (``policy.dimension_overrides``) that LeRobot took from module-level names swapped while it wrote them."""
    tiny = json.loads((FIXTURES / case / "reference.json").read_text())["tiny_overrides"]
    overrides: dict[str, dict[str, int]] = {variant: dict(dims) for variant, dims in tiny["get_gemma_config"].items()}
    after = tiny["paligemma_config_after_lerobot"]
    overrides["vision"] = {key.removeprefix("vision_config."): int(value) for key, value in after.items()
                           if key.startswith("vision_config.")}
    overrides["text"] = {"vocab_size": int(after["text_config.vocab_size"])}
    shutil.copytree(FIXTURES / case / "pretrained_model", copy)
    train_config = json.loads((copy / "train_config.json").read_text())
    train_config["policy"] = {**train_config.get("policy", {}), "dimension_overrides": overrides}
    (copy / "train_config.json").write_text(json.dumps(train_config, indent=4))
    return copy


def our_policy(case: str, weights: Path) -> torch.nn.Module:
    from safetensors.torch import load_file

    if case == "smolvla_full":
        from lerobot_mg.config.smolvla import SmolVLAConfig
        from lerobot_mg.policies.smolvla import SmolVLAPolicy

        inputs = {"observation.state": {"type": "STATE", "shape": FULL_FEATURES["observation.state"]},
                  "observation.images.top": {"type": "VISUAL", "shape": FULL_FEATURES["observation.images.top"]}}
        policy = SmolVLAPolicy(SmolVLAConfig(), inputs, {"action": {"type": "ACTION", "shape": FULL_FEATURES["action"]}},
                               load_backbone_weights=False)
    else:
        from lerobot_mg.policies.registry import get_policy_class

        os.chdir(FIXTURES)
        directory = Path(f"{case}/pretrained_model")
        if case != "smolvla_tiny":
            directory = with_dimension_overrides(case, weights.parent / "pretrained_model")
        policy = get_policy_class(case.removesuffix("_tiny")).from_pretrained(directory)
    policy.load_state_dict(load_file(str(weights)), strict=True)
    policy.train()
    return policy


def bench_case(case: str, site_packages: str, rounds: int) -> list:
    from benchmarking import BenchResult
    from safetensors.torch import save_file

    workdir = Path(tempfile.mkdtemp(prefix=f"bench_vla_step-{case}-"))
    cwd = Path.cwd()
    worker: subprocess.Popen | None = None
    try:
        if case == "smolvla_full":
            (workdir / "vlm").mkdir()
            batch = full_batch(write_full_vlm(workdir / "vlm"))
        else:
            batch = fixture_batch(case)
        save_file(batch, str(workdir / "batch.safetensors"))
        env = {**os.environ, "PYTHONPATH": site_packages, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        worker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--lerobot-worker", case,
                                   str(workdir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=str(FIXTURES))
        assert worker.stdin is not None and worker.stdout is not None
        ready = worker.stdout.readline()
        if not ready:
            raise RuntimeError(f"LeRobot's worker for {case} exited ({worker.wait()}): its traceback is above")
        ours = our_policy(case, workdir / "weights.safetensors")
        optimizer = torch.optim.AdamW(trainable(ours), lr=LR)
        num_params = sum(p.numel() for p in ours.parameters())

        def theirs_step() -> float:
            worker.stdin.write("step\n")
            worker.stdin.flush()
            return float(json.loads(worker.stdout.readline())["seconds"])

        times: dict[str, list[float]] = {"ours": [], "lerobot": []}
        for index in range(rounds + 1):  # the first round warms up
            order = (("ours", lambda: timed_step(ours, optimizer, batch)), ("lerobot", theirs_step))
            for label, step in order if index % 2 else order[::-1]:
                elapsed = step()
                if index >= 1:
                    times[label].append(elapsed)
        worker.stdin.close()
        worker.wait(timeout=120)
    finally:
        if worker is not None and worker.poll() is None:  # this side failed: LeRobot's waits for a line
            worker.kill()
            worker.wait()
        os.chdir(cwd)
        shutil.rmtree(workdir, ignore_errors=True)
    ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["lerobot"])
    print(f"{case}: ours {ours_s * 1e3:.1f} ms, LeRobot {theirs_s * 1e3:.1f} ms per step (median of {rounds}; "
          f"{num_params:,} parameters; load {os.getloadavg()[0]:.2f})", flush=True)
    return [
        BenchResult(f"{case}_step_ours_over_lerobot", round(ours_s / theirs_s, 3), GOAL, "x"),
        BenchResult(f"{case}_step_ms_ours", round(ours_s * 1e3, 1), None, "ms"),
        BenchResult(f"{case}_step_ms_lerobot", round(theirs_s * 1e3, 1), None, "ms"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per policy for the tiny cases")
    parser.add_argument("--full-rounds", type=int, default=3, help="timed steps per policy for smolvla_full")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--lerobot-worker", nargs=2, metavar=("CASE", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lerobot_worker:
        lerobot_worker(args.lerobot_worker[0], Path(args.lerobot_worker[1]))
        return
    site_packages = os.environ.get("LEROBOT_PEER_SITE_PACKAGES")
    if not site_packages or not (Path(site_packages) / "lerobot").is_dir():
        print("bench_vla_step: lerobot 0.6.1 is not importable (set LEROBOT_PEER_SITE_PACKAGES to its "
              "site-packages); nothing measured")
        return
    from benchmarking import BenchResult, report

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    results = [result for case in args.cases
               for result in bench_case(case, site_packages, args.full_rounds if case == "smolvla_full" else
                                        args.rounds)]
    results += [BenchResult("load_average_1min_before", round(load_before, 2), None, ""),
                BenchResult("load_average_1min_after", round(os.getloadavg()[0], 2), None, "")]
    report("bench_vla_step", results)


if __name__ == "__main__":
    main()
