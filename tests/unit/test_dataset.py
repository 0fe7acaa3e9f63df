import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler
from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.policies.base import features_from_dataset
from tests.data_aids import (
    IMAGE_KEY,
    TINY_EPISODE_LENGTHS,
    TINY_FPS,
    VIDEO_KEY,
    TinyDataset,
    tiny_features,
    write_tiny_dataset,
)
from tests.launch_utils import PUSHT_SLICE

NUMERIC_KEYS = ("observation.state", "action", "observation.environment_state")
# h264 (libx264, CRF 20, yuv420p) on the smooth test gradients measured a mean absolute error of
# ~1.9 and a max of 8 levels out of 255; neighbouring frames differ by >= 10 levels on average.
VIDEO_MEAN_ABS_TOLERANCE = 3 / 255
VIDEO_MAX_ABS_TOLERANCE = 16 / 255


def _video_errors(decoded_CHW: torch.Tensor, expected_HWC: np.ndarray) -> tuple[float, float]:
    diff = np.abs(decoded_CHW.permute(1, 2, 0).numpy() - expected_HWC.astype(np.float32) / 255.0)
    return float(diff.mean()), float(diff.max())


def test_round_trip_values(tiny_dataset: TinyDataset) -> None:
    dataset = LeRobotDataset(tiny_dataset.root)
    assert len(dataset) == sum(TINY_EPISODE_LENGTHS) == 22
    assert dataset.num_episodes == 3 and dataset.fps == TINY_FPS
    visual = features_from_dataset(dataset.features, None)[0]
    assert [key for key, spec in visual.items() if spec["type"] == "VISUAL"] == [IMAGE_KEY, VIDEO_KEY]
    for idx in range(len(dataset)):
        item = dataset[idx]
        for key in NUMERIC_KEYS:
            assert item[key].dtype == torch.float32
            np.testing.assert_array_equal(item[key].numpy(), tiny_dataset.frames[key][idx])
        image = item[IMAGE_KEY]
        assert image.shape == (3, 24, 32) and image.dtype == torch.float32
        np.testing.assert_array_equal(
            (image * 255).round().byte().permute(1, 2, 0).numpy(), tiny_dataset.frames[IMAGE_KEY][idx]
        )
        assert item[VIDEO_KEY].shape == (3, 32, 48)
        mean_error, max_error = _video_errors(item[VIDEO_KEY], tiny_dataset.frames[VIDEO_KEY][idx])
        assert mean_error <= VIDEO_MEAN_ABS_TOLERANCE and max_error <= VIDEO_MAX_ABS_TOLERANCE, (
            idx,
            mean_error,
            max_error,
        )
        assert (
            item["index"].dtype == torch.int64 and item["index"].shape == () and item["index"].item() == idx
        )
        assert item["episode_index"].item() == tiny_dataset.episode_index[idx]
        assert item["frame_index"].item() == tiny_dataset.frame_index[idx]
        assert item["timestamp"].dtype == torch.float32
        assert item["timestamp"].item() == pytest.approx(tiny_dataset.frame_index[idx] / TINY_FPS)
        assert item["task"] == tiny_dataset.tasks[idx]
    assert dataset[6]["task_index"].item() == 1 and dataset[15]["task_index"].item() == 0


def test_round_trip_files_and_metadata(tiny_dataset: TinyDataset) -> None:
    root = tiny_dataset.root
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0"
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 22, 2)
    assert set(info["features"]) >= {"timestamp", "frame_index", "episode_index", "index", "task_index"}
    assert info["features"][VIDEO_KEY]["info"]["video.codec"] == "h264"
    assert info["features"][VIDEO_KEY]["info"]["video.pix_fmt"] == "yuv420p"
    assert (root / "videos" / VIDEO_KEY / "chunk-000" / "file-000.mp4").is_file()

    data_file = pq.ParquetFile(root / "data/chunk-000/file-000.parquet")
    assert data_file.metadata.num_row_groups == 3
    assert VIDEO_KEY not in data_file.schema_arrow.names
    assert str(data_file.schema_arrow.field(IMAGE_KEY).type) == "struct<bytes: binary, path: string>"

    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [row["length"] for row in episodes] == list(TINY_EPISODE_LENGTHS)
    assert [row["dataset_from_index"] for row in episodes] == [0, 6, 15]
    assert [row[f"videos/{VIDEO_KEY}/from_timestamp"] for row in episodes] == pytest.approx([0.0, 0.6, 1.5])
    assert [row[f"videos/{VIDEO_KEY}/to_timestamp"] for row in episodes] == pytest.approx([0.6, 1.5, 2.2])
    np.testing.assert_allclose(
        episodes[1]["stats/action/mean"], tiny_dataset.frames["action"][6:15].astype(np.float64).mean(axis=0)
    )

    tasks = pq.read_table(root / "meta/tasks.parquet").to_pandas()
    assert tasks.index.name == "task"
    assert dict(zip(tasks.index, tasks["task_index"])) == {"pick up the cube": 0, "put the cube down": 1}


def test_stats_equal_numpy(tiny_dataset: TinyDataset) -> None:
    stats = LeRobotDataset(tiny_dataset.root).stats
    for key in NUMERIC_KEYS:
        values = tiny_dataset.frames[key].astype(np.float64)
        expected = {
            "mean": values.mean(axis=0),
            "std": values.std(axis=0),
            "min": values.min(axis=0),
            "max": values.max(axis=0),
            "q01": np.quantile(values, 0.01, axis=0),
            "q99": np.quantile(values, 0.99, axis=0),
        }
        for name, value in expected.items():
            assert stats[key][name].dtype == torch.float32
            np.testing.assert_allclose(
                stats[key][name].numpy(), value, rtol=1e-6, atol=1e-6, err_msg=f"{key}/{name}"
            )
        assert stats[key]["count"].tolist() == [22]
    # Every frame of these short episodes enters the image stats, so pooling must match numpy exactly.
    pixels = tiny_dataset.frames[IMAGE_KEY].reshape(-1, 3).astype(np.float64) / 255.0
    image_stats = stats[IMAGE_KEY]
    assert image_stats["mean"].shape == (3, 1, 1)
    np.testing.assert_allclose(image_stats["mean"].flatten().numpy(), pixels.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(image_stats["std"].flatten().numpy(), pixels.std(axis=0), rtol=1e-5)
    np.testing.assert_allclose(image_stats["min"].flatten().numpy(), pixels.min(axis=0))
    np.testing.assert_allclose(image_stats["max"].flatten().numpy(), pixels.max(axis=0))
    np.testing.assert_allclose(stats["frame_index"]["max"].numpy(), [8.0])


def test_delta_timestamps_pad_at_episode_edges(tiny_dataset: TinyDataset) -> None:
    dataset = LeRobotDataset(
        tiny_dataset.root,
        delta_timestamps={
            "action": [0.0, 0.1, 0.2, 0.3],
            "observation.state": [-0.2, -0.1, 0.0],
            VIDEO_KEY: [-0.1, 0.0],
        },
    )
    actions = tiny_dataset.frames["action"]
    states = tiny_dataset.frames["observation.state"]

    first = dataset[0]  # first frame of episode 0
    assert first["action"].shape == (4, 3)
    np.testing.assert_array_equal(first["action"].numpy(), actions[0:4])
    assert first["action_is_pad"].tolist() == [False, False, False, False]
    assert first["observation.state_is_pad"].tolist() == [True, True, False]
    np.testing.assert_array_equal(first["observation.state"].numpy(), states[[0, 0, 0]])

    last = dataset[4]  # second to last frame of episode 0 (frames 0..5): must not reach episode 1
    assert last["action_is_pad"].tolist() == [False, False, True, True]
    np.testing.assert_array_equal(last["action"].numpy(), actions[[4, 5, 5, 5]])

    start_of_second = dataset[6]  # first frame of episode 1: no state from episode 0
    assert start_of_second["observation.state_is_pad"].tolist() == [True, True, False]
    np.testing.assert_array_equal(start_of_second["observation.state"].numpy(), states[[6, 6, 6]])
    assert start_of_second[f"{VIDEO_KEY}_is_pad"].tolist() == [True, False]
    assert start_of_second[VIDEO_KEY].shape == (2, 3, 32, 48)
    for frames in start_of_second[VIDEO_KEY]:
        mean_error, _ = _video_errors(frames, tiny_dataset.frames[VIDEO_KEY][6])
        assert mean_error <= VIDEO_MEAN_ABS_TOLERANCE

    end = dataset[21]  # the very last frame of the dataset
    assert end["action_is_pad"].tolist() == [False, True, True, True]
    np.testing.assert_array_equal(end["action"].numpy(), actions[[21, 21, 21, 21]])


def test_delta_timestamps_validation(tiny_dataset: TinyDataset) -> None:
    with pytest.raises(ValueError, match=r"not multiples of 1/fps = 0.100000s \(fps=10\)"):
        LeRobotDataset(tiny_dataset.root, delta_timestamps={"action": [0.0, 0.05]})
    with pytest.raises(ValueError, match=r"delta_timestamps\['actions'\]: 'actions' is not a feature .*\. Fix: "):
        LeRobotDataset(tiny_dataset.root, delta_timestamps={"actions": [0.0]})
    # Within tolerance of the 1/fps grid is accepted (float noise from 1/fps arithmetic).
    dataset = LeRobotDataset(tiny_dataset.root, delta_timestamps={"action": [0.0, 0.1 + 5e-5]})
    assert dataset.delta_indices["action"].tolist() == [0, 1]


def test_episode_subset(tiny_dataset: TinyDataset) -> None:
    dataset = LeRobotDataset(tiny_dataset.root, episodes=[2, 1], delta_timestamps={"action": [0.0, 0.1]})
    assert len(dataset) == 9 + 7 and dataset.num_episodes == 2 and dataset.episode_indices == [1, 2]
    first = dataset[0]
    assert first["index"].item() == 6 and first["episode_index"].item() == 1
    # Video frames of later episodes sit after the earlier ones in the shared mp4.
    mean_error, _ = _video_errors(dataset[10][VIDEO_KEY], tiny_dataset.frames[VIDEO_KEY][16])
    assert mean_error <= VIDEO_MEAN_ABS_TOLERANCE
    np.testing.assert_array_equal(dataset[8]["action"].numpy(), tiny_dataset.frames["action"][[14, 14]])
    assert dataset[8]["action_is_pad"].tolist() == [False, True]
    with pytest.raises(ValueError, match=r"dataset.root has no episode \[7\]"):
        LeRobotDataset(tiny_dataset.root, episodes=[0, 7])


def test_fingerprint(tiny_dataset: TinyDataset, tmp_path: Path) -> None:
    fingerprint = LeRobotDataset(tiny_dataset.root).fingerprint()
    assert len(fingerprint) == 16
    assert LeRobotDataset(tiny_dataset.root, episodes=[0]).fingerprint() == fingerprint
    other = write_tiny_dataset(tmp_path / "other", with_video=False, seed=1)
    assert LeRobotDataset(other.root).fingerprint() != fingerprint


def test_dataloader_workers_with_resumable_sampler(tiny_dataset: TinyDataset) -> None:
    dataset = LeRobotDataset(tiny_dataset.root)
    dataset[0]  # opens a video container in the parent, which forked workers must not reuse
    sampler = ResumableBatchSampler(len(dataset), batch_size=4, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    batches = list(loader)
    assert len(batches) == 5
    for batch, indices in zip(batches, sampler):
        assert batch["index"].tolist() == indices
        for row, idx in enumerate(indices):
            mean_error, _ = _video_errors(batch[VIDEO_KEY][row], tiny_dataset.frames[VIDEO_KEY][idx])
            assert mean_error <= VIDEO_MEAN_ABS_TOLERANCE


def test_av1_round_trip(tmp_path: Path) -> None:
    tiny = write_tiny_dataset(tmp_path / "av1", episode_lengths=(3, 4), tasks=("a", "b"), video_codec="av1")
    info = json.loads((tiny.root / "meta/info.json").read_text())
    assert info["features"][VIDEO_KEY]["info"]["video.codec"] == "av1"
    dataset = LeRobotDataset(tiny.root)
    for idx in range(len(dataset)):
        # AV1 at CRF 30 (LeRobot's default) is coarser than our h264 setting.
        mean_error, _ = _video_errors(dataset[idx][VIDEO_KEY], tiny.frames[VIDEO_KEY][idx])
        assert mean_error <= 6 / 255, (idx, mean_error)


def test_writer_refuses_non_empty_root(tiny_dataset: TinyDataset) -> None:
    with pytest.raises(ValueError, match="already exists and is not empty; refusing to overwrite"):
        LeRobotDatasetWriter(tiny_dataset.root, fps=10, features=tiny_features())


def test_writer_user_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="height and width must be even"):
        LeRobotDatasetWriter(
            tmp_path / "a", fps=10, features={"cam": {"dtype": "video", "shape": [31, 32, 3]}}
        )
    with pytest.raises(ValueError, match="video_codec='vp9': is not supported. Fix: "):
        LeRobotDatasetWriter(tmp_path / "b", fps=10, features=tiny_features(), video_codec="vp9")
    with pytest.raises(ValueError, match="written by the writer itself"):
        LeRobotDatasetWriter(tmp_path / "c", fps=10, features={"index": {"dtype": "int64", "shape": [1]}})
    writer = LeRobotDatasetWriter(
        tmp_path / "d", fps=10, features={"action": {"dtype": "float32", "shape": [2]}}
    )
    with pytest.raises(ValueError, match=r"missing \['action'\], unexpected \['actions'\]"):
        writer.add_frame({"actions": np.zeros(2)})
    with pytest.raises(ValueError, match=r"frame\['action'\]\.shape=\(3,\): the feature's shape is \(2,\)\. Fix: "):
        writer.add_frame({"action": np.zeros(3)})
    with pytest.raises(ValueError, match="before any save_episode"):
        writer.finalize()
    # The rejected frames left nothing behind: the episode holds exactly the one valid frame.
    writer.add_frame({"action": np.array([1.5, -2.0])})
    writer.save_episode("reach")
    writer.finalize()
    dataset = LeRobotDataset(tmp_path / "d")
    assert len(dataset) == 1 and dataset[0]["action"].tolist() == [1.5, -2.0]
    assert dataset.stats["action"]["mean"].tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="already finalized"):
        writer.add_frame({"action": np.zeros(2)})


def test_reader_rejects_unfinished_dataset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no meta/info.json"):
        LeRobotDataset(tmp_path)


def test_pusht_slice_from_lerobot() -> None:
    assert PUSHT_SLICE.is_dir(), f"the PushT fixture is missing: {PUSHT_SLICE}"
    dataset = LeRobotDataset(PUSHT_SLICE, delta_timestamps={"action": [k / 10 for k in range(5)]})
    assert len(dataset) == 420 and dataset.num_episodes == 3
    visual = features_from_dataset(dataset.features, None)[0]
    assert [key for key, spec in visual.items() if spec["type"] == "VISUAL"] == ["observation.image"]
    item = dataset[0]
    image = item["observation.image"]
    assert image.shape == (3, 96, 96) and image.dtype == torch.float32
    assert 0.0 <= image.min().item() and image.max().item() <= 1.0 and image.std().item() > 0
    assert item["task"] == "Push the T-shaped block onto the T-shaped target."
    assert item["observation.state"].shape == (2,)
    assert dataset.stats["observation.state"]["mean"].shape == (2,)
    assert dataset.stats["observation.image"]["mean"].shape == (3, 1, 1)
    assert dataset.stats["action"]["count"].tolist() == [420.0]

    raw_actions = np.stack(
        pq.read_table(PUSHT_SLICE / "data/chunk-000/file-000.parquet", columns=["action"])["action"].to_numpy(
            zero_copy_only=False
        )
    )
    last_of_first_episode = dataset[159]  # episode 0 has 161 frames
    assert last_of_first_episode["episode_index"].item() == 0
    assert last_of_first_episode["action"].shape == (5, 2)
    assert last_of_first_episode["action_is_pad"].tolist() == [False, False, True, True, True]
    np.testing.assert_array_equal(
        last_of_first_episode["action"].numpy(), raw_actions[[159, 160, 160, 160, 160]]
    )
    np.testing.assert_array_equal(dataset[161]["action"].numpy(), raw_actions[161:166])
    assert dataset[161]["episode_index"].item() == 1
