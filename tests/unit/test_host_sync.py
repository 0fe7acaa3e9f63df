"""No host sync per step.

Inside the training loop, no tensor is read on the host (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``)
except on log and checkpoint steps, where the metrics are reduced and read. The runs keep the EMA of their weights
(``ema.enable=true``): its update after every optimizer update reads nothing. The real trainer runs in a child
process with those methods counting their calls during each loop step (from the start of the step to the start of
the next batch's wait; the DataLoader's host-side tensors, such as the sampler's indices, are not the device's, nor
are the step counts torch's optimizers keep on the host).

And no training step of any policy (ACT, Diffusion, pi0, pi0.5, SmolVLA) makes a host-device round trip: under
tests/host_sync_aids.HostSyncDetector, which tells on a CPU what would wait for a GPU (a device tensor read back, host
data copied to the device, an op whose shape depends on the device's values), each step of a real run records
nothing. The VLAs' prompts are tokenised in the DataLoader's workers for that (pi0.5's finished on the device), which
gives the host's tokens. On a GPU each such wait leaves the device idle between kernels; ``scripts/gpu_check.sh``
runs the loop under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.host_sync_aids import HostSyncDetector
from tests.launch_utils import REPO, TINY_RUN, run_train
from tests.vla_preset_aids import PRESET_TEST_OVERRIDES, VLA_PRESETS, write_vla_dataset

PROBE = '''
import json, os, sys
from pathlib import Path

import torch

import lerobot_mg.train as train_module
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.scripts_entry import train

state = {"active": False, "count": 0, "step": 0, "what": []}
counts, what = {}, {}


def counting(name):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        # torch's optimizers keep their step counts on the host (unless capturable or fused): reading them is free.
        if state["active"] and "/torch/optim/" not in caller:
            state["count"] += 1
            state["what"].append(f"{name} {caller}:{sys._getframe(1).f_lineno}")
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, wrapper)


for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
    counting(name)


def end_step():
    if state["step"]:
        counts[state["step"]] = state["count"]
        what[state["step"]] = sorted(set(state["what"]))
    state.update(active=False, count=0, what=[])


_batches = train_module.endless_batches


def counting_batches(*args, **kwargs):
    inner = _batches(*args, **kwargs)
    while True:
        end_step()
        batch = next(inner)
        state["step"] += 1
        state["active"] = True
        yield batch


_close = CheckpointManager.close


def close(self):
    end_step()
    out = Path(os.environ["SYNC_COUNTS"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"counts": counts, "what": what}))
    _close(self)


train_module.endless_batches = counting_batches
CheckpointManager.close = close
train()
'''

STEPS, LOG_FREQ, SAVE_FREQ = 12, 5, 8


@pytest.mark.parametrize(("nproc", "layout"), [(1, []), (2, ["parallelism.dp_shard=2"])], ids=["single", "fsdp2"])
def test_no_host_reads_on_steps_that_neither_log_nor_save(nproc: int, layout: list[str], tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    counts_dir = tmp_path / "counts"
    run_train([*TINY_RUN, f"steps={STEPS}", f"log_freq={LOG_FREQ}", f"checkpoint.save_freq={SAVE_FREQ}",
               "optimizer.grad_clip_norm=10", "ema.enable=true", f"output_dir={tmp_path / 'run'}", *layout],
              nproc=nproc, timeout=240, env={"SYNC_COUNTS": str(counts_dir)}, script=probe)
    for rank in range(nproc):
        recorded = json.loads((counts_dir / f"rank{rank}.json").read_text())
        counts = {int(step): n for step, n in recorded["counts"].items()}
        assert sorted(counts) == list(range(1, STEPS + 1))
        quiet = {step for step in counts if step % LOG_FREQ and step % SAVE_FREQ and step != STEPS}
        assert {step: counts[step] for step in quiet} == dict.fromkeys(quiet, 0), recorded["what"]
        assert all(counts[step] > 0 for step in (LOG_FREQ, 2 * LOG_FREQ)), counts  # the counting does count


STEP_PROBE = '''
import json, os, sys
from pathlib import Path

sys.path.insert(0, os.environ["REPO_ROOT"])
from tests.host_sync_aids import HostSyncDetector

import lerobot_mg.step as step_module
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.scripts_entry import train

found = []
_step = step_module.Stepper.step


def step(self, batch):
    detector = HostSyncDetector()
    detector.host(*[batch[key] for key in step_module.HOST_KEYS if key in batch])
    with detector:
        logs = _step(self, batch)
    found.append(detector.summary())
    return logs


_close = CheckpointManager.close


def close(self):
    Path(os.environ["SYNC_FOUND"]).write_text(json.dumps(found))
    _close(self)


step_module.Stepper.step = step
CheckpointManager.close = close
train()
'''

# Each policy on a tiny run: ACT and Diffusion on the PushT slice, the VLAs' CPU-size presets on a written dataset
# with a camera and tasks (tests/vla_preset_aids.py).
POLICY_RUNS = {
    "act": [*TINY_RUN],
    "diffusion": ["experiment=pusht_debug_diffusion", "logging.progress_bar=false", "logging.wandb.mode=disabled"],
    **{preset.removeprefix("aloha_").removesuffix("_tiny"): [f"experiment={preset}", "dataset=lerobot",
                                                              *PRESET_TEST_OVERRIDES] for preset in VLA_PRESETS},
}


@pytest.fixture(scope="module")
def vla_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vla_dataset(tmp_path_factory.mktemp("vla_data") / "data")


@pytest.mark.parametrize("policy", sorted(POLICY_RUNS))
def test_a_training_step_makes_no_host_device_round_trip(policy: str, vla_dataset: Path, tmp_path: Path) -> None:
    """Every loop step of each policy (forward, backward, optimizer update; the batch's own non-blocking copy to the
    device aside) under tests/host_sync_aids.HostSyncDetector: nothing read back from the device, no host data
    copied to it, no op whose shape depends on the device's values. Two workers collate the batches (the
    tokenised prompts of the VLAs come from there)."""
    probe = tmp_path / "probe.py"
    probe.write_text(STEP_PROBE)
    found = tmp_path / "found.json"
    overrides = [*POLICY_RUNS[policy], "steps=3", "log_freq=1", "checkpoint.save_freq=3", "num_workers=2",
                 f"output_dir={tmp_path / 'run'}"]
    if policy in ("pi0", "pi05", "smolvla"):
        overrides.append(f"dataset.root={vla_dataset}")
    run_train(overrides, timeout=240, script=probe, env={"SYNC_FOUND": str(found), "REPO_ROOT": str(REPO)})
    per_step = json.loads(found.read_text())
    assert len(per_step) == 3
    assert per_step == [[]] * 3, "\n".join(sorted({line for step in per_step for line in step}))


def test_the_detector_flags_each_kind_of_round_trip() -> None:
    """What tests/host_sync_aids.HostSyncDetector records, on the patterns the VLA step had: a mask made from a
    list on the device, draws made on the host and copied, the state read back, a boolean index, a scalar read; and
    what it leaves alone: the same work done on the device, host reads of the host's own tensors."""
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4)
    seeds = torch.arange(3)

    def found(work) -> list[str]:
        with HostSyncDetector() as detector:
            detector.host(seeds)
            work()
        return [what for what, _ in detector.events]

    assert found(lambda: torch.tensor([1, 0, 1], device=x.device)) == [
        "torch.tensor(<host data>, device=...) copies host data to the device"]
    assert found(lambda: torch.normal(0.0, 1.0, size=(3, 4), device="cpu").to(x.device)) == [
        "Tensor.to(<device>) of a host tensor copies it to the device"]
    assert found(lambda: x @ weight + torch.zeros(3, 4)) == [
        "add: a host tensor used with device tensors (a copy, or an error, on a GPU)"]
    assert found(lambda: x.detach().cpu().numpy()) == ["Tensor.cpu() of a device tensor"]
    assert "aten._local_scalar_dense waits for the device's values" in found(lambda: float(x.sum()))
    assert found(lambda: x[x > 0]) == ["aten.index waits for the device's values"]
    assert found(lambda: x.nonzero()) == ["aten.nonzero waits for the device's values"]
    clean = found(lambda: (seeds.tolist(), torch.zeros(3, 4, device=x.device) + x @ weight,
                           torch.full((3,), 0.5, device=x.device) * torch.tensor(2.0),
                           torch.bucketize(x, torch.linspace(-1, 1, 5, device=x.device))))
    assert clean == []


@pytest.mark.parametrize("tokenizer", ["paligemma", "pi05_fixture"])
def test_pi05_prompts_finished_on_the_device_are_the_hosts(tokenizer: str) -> None:
    """pi0.5's prompt made in two halves (the head tokenised in the workers, the state's bins and their tokens on
    the device) gives the tokens and mask of the whole prompt tokenised on the host, as LeRobot's steps do: states
    below, at and above the bins' edges, one dimension and fourteen, a prompt cut at max_length."""
    from lerobot_mg.processors.language import (
        STATE_BIN_EDGES,
        Pi05StatePromptStep,
        TokenizerStep,
        worker_language,
    )
    from lerobot_mg.processors.pipeline import PolicyProcessorPipeline

    name = (REPO / "lerobot_mg/data/vla_tiny/paligemma" if tokenizer == "paligemma"
            else REPO / "tests/fixtures/lerobot_0_6_1/pi05_tiny/tiny_tokenizer")
    generator = torch.Generator().manual_seed(0)
    tasks = ["Pick up the cube.", "x", "Put the_cube back\n", "a b c d e f g h i j k l m n o p q r s t", "",
             "Transfer the cube"]
    for max_length in (24, 200):
        pipeline = PolicyProcessorPipeline("policy_preprocessor",
                                           [Pi05StatePromptStep(), TokenizerStep(str(name), max_length=max_length)])
        in_workers = worker_language(pipeline)
        assert in_workers is not None
        for dims in (1, 14):
            state = torch.randn(len(tasks), dims, generator=generator)
            state[:4, 0] = torch.tensor([-1.0, 1.0, -1.0000001, float(STATE_BIN_EDGES[100])])
            host = pipeline({"observation.state": state, "task": tasks})
            device = pipeline(in_workers({"observation.state": state, "task": tasks}))
            for key in ("observation.language.tokens", "observation.language.attention_mask"):
                assert device[key].dtype == host[key].dtype and torch.equal(device[key], host[key]), key
            assert sorted(device) == sorted(host)
