"""The dataset reads only what the policy reads, and a broken dataset stops a run before its first step with the
file named; a data worker that dies stops the run with the worker named instead of hanging it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler
from lerobot_mg.data.loader import endless_batches
from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.errors import ConfigError
from tests.data_aids import (
    IMAGE_KEY,
    TINY_FPS,
    VIDEO_KEY,
    VIDEO_SHAPE_HWC,
    TinyDataset,
    smooth_video_frame,
)
from tests.launch_utils import (
    REPO,
    TINY_RUN,
    clean_env,
    interval_metrics,
    kill_tree,
    launch_command,
    run_train,
)
from tests.unit.test_dataset import VIDEO_MAX_ABS_TOLERANCE, VIDEO_MEAN_ABS_TOLERANCE

STATE_ONLY = ["observation.state", "action"]
# A policy on the tiny dataset: its shortest episode has 6 frames.
TINY_POLICY = ["policy.chunk_size=5", "policy.n_action_steps=5", "batch_size=4"]


def _mp4s(root: Path) -> list[Path]:
    return sorted((root / "videos").glob("*/chunk-*/file-*.mp4"))


def test_a_state_only_read_opens_no_camera(tiny_dataset: TinyDataset) -> None:
    for mp4 in _mp4s(tiny_dataset.root):
        mp4.unlink()  # as a dataset downloaded without its videos: opening one would raise
    dataset = LeRobotDataset(tiny_dataset.root, {"action": [0.0, 0.1]}, keys=STATE_ONLY)
    item = dataset[3]
    assert VIDEO_KEY not in item and IMAGE_KEY not in item and "observation.environment_state" not in item
    np.testing.assert_array_equal(item["observation.state"].numpy(), tiny_dataset.frames["observation.state"][3])
    assert item["action"].shape == (2, 3) and item["index"].item() == 3
    with pytest.raises(ConfigError, match=rf"{VIDEO_KEY}/chunk-000/file-000.mp4: does not exist, but the policy "
                                          r"reads its camera\. Fix: download"):
        LeRobotDataset(tiny_dataset.root, keys=[*STATE_ONLY, VIDEO_KEY])


def _drop_feature_from_info(root: Path) -> str:
    info = json.loads((root / "meta/info.json").read_text())
    del info["features"]["observation.environment_state"]
    (root / "meta/info.json").write_text(json.dumps(info))
    return r"columns without a feature \['observation.environment_state'\]"


def _add_feature_to_info(root: Path) -> str:
    info = json.loads((root / "meta/info.json").read_text())
    info["features"]["observation.effort"] = {"dtype": "float32", "shape": [2], "names": None}
    (root / "meta/info.json").write_text(json.dumps(info))
    return r"features without a column \['observation.effort'\]"


def _truncate_video(root: Path) -> str:
    """The mp4 rewritten with its last episode's frames cut short (a download that stopped early, re-muxed)."""
    path = _mp4s(root)[0]
    height, width, _ = VIDEO_SHAPE_HWC
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=TINY_FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(18):  # 22 frames are needed
            frame = av.VideoFrame.from_ndarray(smooth_video_frame(0, index), format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, TINY_FPS)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return r"file-000.mp4: holds 18 frames but episode 2 ends at 2\.200s in it \(22 frames at 10 fps\)"


def _remove_parquet(root: Path) -> str:
    (root / "data/chunk-000/file-000.parquet").unlink()
    return r"data/chunk-000/file-000.parquet: does not exist, but the episodes table"


@pytest.mark.parametrize("corrupt", [_remove_parquet, _drop_feature_from_info, _add_feature_to_info, _truncate_video])
def test_a_corrupt_dataset_is_refused_with_the_file_named(tiny_dataset: TinyDataset, corrupt) -> None:
    LeRobotDataset(tiny_dataset.root)  # the negative control: intact, it loads
    expected = corrupt(tiny_dataset.root)
    with pytest.raises(ConfigError, match=expected) as error:
        LeRobotDataset(tiny_dataset.root)
    assert "Fix: download the dataset again" in str(error.value)


def _two_camera_dataset(root: Path) -> tuple[Path, dict[str, np.ndarray]]:
    height, width, _ = VIDEO_SHAPE_HWC
    cameras = {"observation.images.left": 0, "observation.images.right": 3}  # a different picture per camera
    features = {"action": {"dtype": "float32", "shape": [2]},
                **{key: {"dtype": "video", "shape": [height, width, 3]} for key in cameras}}
    writer = LeRobotDatasetWriter(root, fps=TINY_FPS, features=features)
    written: dict[str, list[np.ndarray]] = {key: [] for key in cameras}
    for episode, length in enumerate((5, 7)):
        for step in range(length):
            frame = {key: smooth_video_frame(episode + shift, step) for key, shift in cameras.items()}
            writer.add_frame({"action": np.zeros(2, np.float32), **frame})
            for key, image in frame.items():
                written[key].append(image)
        writer.save_episode("look")
    writer.finalize()
    return root, {key: np.stack(images) for key, images in written.items()}


def test_uint8_threaded_decode_returns_todays_values(tmp_path: Path) -> None:
    root, written = _two_camera_dataset(tmp_path / "two")
    cameras = list(written)
    today = LeRobotDataset(root)  # float32, one camera after the other
    threaded = LeRobotDataset(root, uint8_visuals=True)
    single = {key: LeRobotDataset(root, keys=[key]) for key in cameras}
    for idx in range(len(today)):
        reference, fast = today[idx], threaded[idx]
        for key in cameras:
            assert fast[key].dtype == torch.uint8 and fast[key].shape == (3, *VIDEO_SHAPE_HWC[:2])
            # The same decoded frame: uint8 scaled on the device gives today's float values exactly.
            torch.testing.assert_close(fast[key].float().div_(255.0), reference[key], rtol=0, atol=0)
            torch.testing.assert_close(single[key][idx][key], reference[key], rtol=0, atol=0)
            error = np.abs(reference[key].permute(1, 2, 0).numpy() - written[key][idx] / 255.0)
            assert error.mean() <= VIDEO_MEAN_ABS_TOLERANCE and error.max() <= VIDEO_MAX_ABS_TOLERANCE, (idx, key)
    # Forked workers after the parent used its decode threads: each makes its own, values unchanged.
    sampler = ResumableBatchSampler(len(threaded), batch_size=3, seed=1)
    loader = torch.utils.data.DataLoader(threaded, batch_sampler=sampler, num_workers=2)
    for batch, indices in zip(loader, sampler):
        assert batch["index"].tolist() == indices
        for key in cameras:
            expected = torch.stack([threaded[i][key] for i in indices])
            torch.testing.assert_close(batch[key], expected, rtol=0, atol=0)


def _tiny_run(root: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [*TINY_RUN, f"dataset.root={root}", *TINY_POLICY, f"output_dir={run_dir}", *overrides]


def test_training_reads_only_the_policys_inputs(tiny_dataset: TinyDataset, tmp_path: Path) -> None:
    """As a user with a `lerobot-record` dataset whose videos were not downloaded: a state-only policy trains; a
    policy that reads the camera stops before its first step, naming the file (exit 2, no traceback)."""
    for mp4 in _mp4s(tiny_dataset.root):
        mp4.unlink()
    run_train(_tiny_run(tiny_dataset.root, tmp_path / "state", "steps=2", "checkpoint.save_checkpoint=false"))
    assert [m["step"] for m in interval_metrics(tmp_path / "state")] == [2]

    camera = run_train(_tiny_run(tiny_dataset.root, tmp_path / "camera", "steps=2",
                                 f"policy.observation_keys=[observation.state,{VIDEO_KEY}]"),
                       check=False, env={"HYDRA_FULL_ERROR": "0"})
    assert camera.returncode == 2, camera.stdout[-3000:]
    assert f"{VIDEO_KEY}/chunk-000/file-000.mp4: does not exist, but the policy reads its camera" in camera.stdout
    assert "Traceback" not in camera.stdout and not (tmp_path / "camera" / "ledger.jsonl").exists()


def _children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in children.read_text().split()] if children.exists() else []


def test_a_killed_data_worker_stops_the_run_naming_it(tiny_dataset: TinyDataset, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [*launch_command(1, "python"),
           *_tiny_run(tiny_dataset.root, run_dir, "steps=100000", "num_workers=2", "log_freq=1",
                      "checkpoint.save_checkpoint=false")]
    proc = subprocess.Popen(cmd, env=clean_env(None), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "ledger.jsonl").exists() or '"interval"' not in (run_dir / "ledger.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers  # the two DataLoader workers (forked: the trainer's only children)
        os.kill(workers[0], signal.SIGKILL)
        # A watchdog, not a measure of speed: a loop that never noticed the dead worker would train for ever.
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode != 0
    # Ours (the loop was waiting for a batch) or torch's SIGCHLD handler's (it was elsewhere): the worker is named.
    named = [f"DataLoader worker {i} (pid {workers[0]}) was killed by SIGKILL" for i in (0, 1)]
    named.append(f"DataLoader worker (pid {workers[0]}) is killed by signal: Killed")
    assert any(line in output for line in named), output[-3000:]


def _delivered(dataset: LeRobotDataset, sampler: ResumableBatchSampler, num_workers: int, steps: int) -> list[list]:
    """What the training loop receives over ``steps`` loop steps: index and the image bytes, as train() advances."""
    batches, delivered = endless_batches(dataset, sampler, num_workers, pin_memory=False), []
    for _ in range(steps):
        batch = next(batches)
        sampler.advance()
        delivered.append([batch["index"].tolist(), batch[VIDEO_KEY].sum().item()])
    batches.close()
    return delivered


def test_persistent_workers_keep_the_order_across_epochs_and_resume(tiny_dataset: TinyDataset) -> None:
    dataset = LeRobotDataset(tiny_dataset.root, keys=[VIDEO_KEY], uint8_visuals=True)
    straight = _delivered(dataset, ResumableBatchSampler(len(dataset), 4, seed=5), 0, 12)  # 5 steps an epoch
    assert straight == _delivered(dataset, ResumableBatchSampler(len(dataset), 4, seed=5), 2, 12)
    saved = ResumableBatchSampler(len(dataset), 4, seed=5)
    saved.advance(7)  # mid-epoch 1, as a checkpoint saves it
    resumed = ResumableBatchSampler(len(dataset), 4, seed=5)
    resumed.load_state_dict(saved.state_dict())
    assert _delivered(dataset, resumed, 2, 5) == straight[7:]
