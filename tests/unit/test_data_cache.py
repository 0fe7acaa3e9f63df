"""The dataset cache: built once by processes starting together, rebuilt (with a warning) when stale or truncated,
read back to the same items as the parquet files hold, and a rank's private memory that does not grow with the
dataset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler
from lerobot_mg.data import cache as cache_module
from lerobot_mg.data import sampler as sampler_module
from lerobot_mg.data.cache import CACHE_DIRNAME, StaleCacheWarning
from scripts.synthetic_dataset import write_state_dataset
from tests.data_aids import TinyDataset
from tests.launch_utils import PUSHT_SLICE, REPO, clean_env

STATE = ["observation.state", "action"]
CHUNK = {"action": [k / 50 for k in range(-2, 10)]}  # offsets both sides: pads at both episode edges
# Opening a dataset held ~560 bytes a frame in each process before the cache; the cache's growth must stay far below.
MAX_BYTES_PER_FRAME = 56


def _expected(root: Path) -> dict[str, np.ndarray]:
    """Every column of the data files, straight from parquet, in ``index`` order (the reference: no cache)."""
    table = pa.concat_tables([pq.read_table(path) for path in sorted((root / "data").glob("*/*.parquet"))])
    table = table.take(np.argsort(table.column("index").to_numpy(), kind="stable"))
    return {name: np.stack(table.column(name).to_numpy(zero_copy_only=False)) if name in STATE
            else table.column(name).to_numpy() for name in table.column_names}


def _check_items(dataset: LeRobotDataset, expected: dict[str, np.ndarray], indices: list[int]) -> None:
    episode = expected["episode_index"]
    for idx in indices:
        item = dataset[idx]
        assert item["index"].item() == expected["index"][idx]
        np.testing.assert_array_equal(item["observation.state"].numpy(), expected["observation.state"][idx])
        rows = idx + np.arange(-2, 10)
        first = np.searchsorted(episode, episode[idx])
        last = np.searchsorted(episode, episode[idx], side="right") - 1
        np.testing.assert_array_equal(item["action_is_pad"].numpy(), (rows < first) | (rows > last))
        np.testing.assert_array_equal(item["action"].numpy(), expected["action"][np.clip(rows, first, last)])


@pytest.fixture
def state_dataset(tmp_path: Path) -> Path:
    return write_state_dataset(tmp_path / "state", num_frames=2_050, episode_length=100, num_files=3)


def test_items_through_the_cache_equal_the_parquet_files(state_dataset: Path) -> None:
    expected = _expected(state_dataset)
    indices = [0, 1, 99, 100, 101, 1_000, 2_048, 2_049]
    built = LeRobotDataset(state_dataset, CHUNK, keys=STATE)  # builds the cache
    entries = sorted(path.name for path in (state_dataset / CACHE_DIRNAME).iterdir() if path.is_dir())
    assert entries[0] == "episodes" and entries[1].startswith("frames-"), entries
    mapped = LeRobotDataset(state_dataset, CHUNK, keys=STATE)  # reads it
    assert isinstance(mapped._numeric["action"].base, np.memmap)  # a view of the map, not a copy
    for dataset in (built, mapped):
        assert len(dataset) == 2_050
        _check_items(dataset, expected, indices)
    subset = LeRobotDataset(state_dataset, CHUNK, episodes=[20, 3], keys=STATE)  # one cache for every selection
    assert len(subset) == 150 and subset.episode_indices == [3, 20]
    assert subset[0]["index"].item() == 300 and subset[100]["index"].item() == 2_000
    assert subset[149]["action_is_pad"].tolist() == [False] * 3 + [True] * 9


def test_every_feature_kind_through_the_cache(tiny_dataset: TinyDataset) -> None:
    first = LeRobotDataset(tiny_dataset.root, {"action": [0.0, 0.1]})
    second = LeRobotDataset(tiny_dataset.root, {"action": [0.0, 0.1]})
    for idx in range(len(first)):
        a, b = first[idx], second[idx]
        assert a.keys() == b.keys() and a["task"] == b["task"] == tiny_dataset.tasks[idx]
        for key, value in a.items():
            if key != "task":
                assert (value == b[key]).all(), (idx, key)


def test_a_stale_cache_is_rebuilt_with_a_warning(state_dataset: Path) -> None:
    LeRobotDataset(state_dataset, keys=STATE)
    for name in ("data", "meta"):  # another revision of the dataset in the same folder, the cache left beside it
        shutil.rmtree(state_dataset / name)
    write_state_dataset(state_dataset, num_frames=2_050, episode_length=100, num_files=3, seed=1)
    with pytest.warns(StaleCacheWarning, match=r"another revision of the dataset \(stale\); rebuilding it"):
        dataset = LeRobotDataset(state_dataset, CHUNK, keys=STATE)
    _check_items(dataset, _expected(state_dataset), [0, 150, 2_049])


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_cache_is_rebuilt_with_a_warning(state_dataset: Path, damage: str) -> None:
    LeRobotDataset(state_dataset, keys=STATE)
    entry = next((state_dataset / CACHE_DIRNAME).glob("frames-*[!k]"))
    column = entry / "action.npy"
    if damage == "truncate":
        os.truncate(column, column.stat().st_size // 2)  # as a disk that filled up mid-write
    else:
        column.unlink()
    with pytest.warns(StaleCacheWarning, match=r"action\.npy .*\(truncated\); rebuilding it"):
        dataset = LeRobotDataset(state_dataset, CHUNK, keys=STATE)
    _check_items(dataset, _expected(state_dataset), [0, 1_999, 2_049])
    json.loads((entry / "manifest.json").read_text())  # whole again


def test_a_read_only_dataset_caches_under_the_user_cache_folder(state_dataset: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    writable = os.access
    monkeypatch.setattr(cache_module.os, "access",
                        lambda path, mode: False if Path(path).resolve() == state_dataset.resolve()
                        else writable(path, mode))
    monkeypatch.setenv("LEROBOT_MG_CACHE", str(tmp_path / "user_cache"))
    dataset = LeRobotDataset(state_dataset, CHUNK, keys=STATE)
    assert not (state_dataset / CACHE_DIRNAME).exists()
    assert dataset.cache_dir.parent == tmp_path / "user_cache" / "dataset_cache"
    _check_items(dataset, _expected(state_dataset), [5])


def test_a_large_permutation_is_mapped_and_equals_the_drawn_one(state_dataset: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = LeRobotDataset(state_dataset, keys=STATE)
    monkeypatch.setattr(sampler_module, "MAP_PERMUTATION_FROM", 1_000)
    mapped = ResumableBatchSampler(len(dataset), 8, seed=3, rank=1, world_size=2, cache_dir=dataset.cache_dir)
    drawn = ResumableBatchSampler(len(dataset), 8, seed=3, rank=1, world_size=2)
    for _ in range(4):  # epochs 0..3: the entries of epochs two behind are removed
        assert list(mapped) == list(drawn)
        mapped.advance(len(mapped))
        drawn.advance(len(drawn))
    assert list(mapped) == list(drawn)
    kept = sorted(path.name for path in dataset.cache_dir.glob("permutation-*") if path.is_dir())
    assert kept == ["permutation-s3-n2050-e3", "permutation-s3-n2050-e4"]


_TOGETHER = """
import os, sys, time
from pathlib import Path
from lerobot_mg.data import cache
from lerobot_mg.data import LeRobotDataset

real_entry = cache.entry

def entry(root, name, key, build):
    def logged(folder):
        with open(os.environ["BUILDS"], "a") as out:
            out.write(f"{os.getpid()} {name.split('-')[0]}\\n")
        time.sleep(0.5)  # a build long enough for the other process to arrive while it runs
        build(folder)
    return real_entry(root, name, key, logged)

cache.entry = entry
go = Path(os.environ["GO"])
while not go.exists():
    time.sleep(0.01)
dataset = LeRobotDataset(sys.argv[1], keys=["observation.state", "action"])
print(float(dataset[777]["action"].sum()), len(dataset))
"""


def test_processes_starting_together_build_the_cache_once(state_dataset: Path, tmp_path: Path) -> None:
    script = tmp_path / "together.py"
    script.write_text(_TOGETHER)
    builds, go = tmp_path / "builds.txt", tmp_path / "go"
    env = clean_env({"BUILDS": str(builds), "GO": str(go)})
    processes = [subprocess.Popen([sys.executable, str(script), str(state_dataset)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    go.touch()
    outputs = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 0, err
        assert "StaleCacheWarning" not in err, err
        outputs.append(out)
    assert outputs[0] == outputs[1]
    built = sorted(line.split()[1] for line in builds.read_text().splitlines())
    assert built == ["episodes", "frames"], built  # each entry once, by either process


_PRIVATE = """
import json, os, sys
from lerobot_mg.data import sampler
from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler

def rollup():
    with open(f"/proc/{os.getpid()}/smaps_rollup") as lines:
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {name: 1024 * int(fields[name].split()[0]) for name in ("Private_Clean", "Private_Dirty", "Anonymous")}

sampler.MAP_PERMUTATION_FROM = 0  # the permutation too, as for a large dataset
before = rollup()
dataset = LeRobotDataset(sys.argv[1], {"action": [k / 50 for k in range(50)]}, keys=["observation.state", "action"])
batches = ResumableBatchSampler(len(dataset), 8, seed=0, world_size=2, cache_dir=dataset.cache_dir)
iterator = iter(batches)
next(iterator)
opened = rollup()
# Reading items maps column pages: clean file pages count as private in smaps while no other process has touched
# them (a run's other ranks and workers soon have), so what reading must not add is anonymous memory.
for batch, _ in zip(iterator, range(25)):
    [dataset[i] for i in batch]
read = rollup()
print(json.dumps({"opened": opened["Private_Clean"] + opened["Private_Dirty"] - before["Private_Clean"]
                  - before["Private_Dirty"], "read": read["Anonymous"] - before["Anonymous"]}))
"""


def test_private_memory_does_not_grow_with_the_dataset(tmp_path: Path) -> None:
    script = tmp_path / "private.py"
    script.write_text(_PRIVATE)
    added = {}
    for frames in (100_000, 400_000):
        root = write_state_dataset(tmp_path / f"d{frames}", num_frames=frames)
        LeRobotDataset(root, keys=STATE)  # the cache exists before the measured open, as on every later start
        # A process of its own per measurement: nothing the other one allocated is counted.
        result = subprocess.run([sys.executable, str(script), str(root)], cwd=REPO, env=clean_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        added[frames] = json.loads(result.stdout.splitlines()[-1])
    for measure in ("opened", "read"):
        per_frame = (added[400_000][measure] - added[100_000][measure]) / 300_000
        assert per_frame < MAX_BYTES_PER_FRAME, (measure, added, per_frame)


def test_the_shipped_pusht_slice_caches_under_the_user_cache_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEROBOT_MG_CACHE", str(tmp_path / "user_cache"))
    dataset = LeRobotDataset(PUSHT_SLICE, keys=["observation.state", "action"])
    assert dataset.cache_dir.parent == tmp_path / "user_cache" / "dataset_cache"
    assert not (PUSHT_SLICE / CACHE_DIRNAME).exists()  # the package's files stay what the wheel ships
