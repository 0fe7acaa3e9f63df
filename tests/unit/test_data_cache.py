"""The dataset cache: outside the dataset's folder, keyed by its fingerprint; built once by processes starting
together, by one winner when processes with no working lock build it at once; rebuilt (with a warning) when stale or
truncated; kept bounded; read back to the same items as the parquet files hold, and a rank's private memory that
does not grow with the dataset."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lerobot_mg.data import LeRobotDataset, ResumableBatchSampler
from lerobot_mg.data import cache as cache_module
from lerobot_mg.data import sampler as sampler_module
from lerobot_mg.data.cache import MANIFEST, StaleCacheWarning
from lerobot_mg.errors import ConfigError
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


@pytest.fixture(autouse=True)
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test's own ``$LEROBOT_MG_CACHE`` (the dataset cache lives under it)."""
    monkeypatch.setenv("LEROBOT_MG_CACHE", str(tmp_path / "user_cache"))
    monkeypatch.delenv(cache_module.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(cache_module.KEEP_DAYS_ENV, raising=False)
    return tmp_path / "user_cache"


@pytest.fixture
def state_dataset(tmp_path: Path) -> Path:
    return write_state_dataset(tmp_path / "state", num_frames=2_050, episode_length=100, num_files=3)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {path.relative_to(root).as_posix(): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(root.rglob("*")) if path.is_file()}


def test_items_through_the_cache_equal_the_parquet_files(state_dataset: Path, user_cache: Path) -> None:
    expected = _expected(state_dataset)
    before = _tree(state_dataset)
    indices = [0, 1, 99, 100, 101, 1_000, 2_048, 2_049]
    built = LeRobotDataset(state_dataset, CHUNK, keys=STATE)  # builds the cache
    assert built.cache_dir == user_cache / "datasets-cache" / built.fingerprint()
    entries = sorted(path.name for path in built.cache_dir.iterdir() if path.is_dir())
    assert entries[0] == "episodes" and entries[1].startswith("frames-"), entries
    assert _tree(state_dataset) == before  # nothing written into the dataset's folder
    mapped = LeRobotDataset(state_dataset, CHUNK, keys=STATE)  # reads it
    assert isinstance(mapped._numeric["action"].base, np.memmap)  # a view of the map, not a copy
    for dataset in (built, mapped):
        assert len(dataset) == 2_050
        _check_items(dataset, expected, indices)
    subset = LeRobotDataset(state_dataset, CHUNK, episodes=[20, 3], keys=STATE)  # one cache for every selection
    assert len(subset) == 150 and subset.episode_indices == [3, 20]
    assert subset[0]["index"].item() == 300 and subset[100]["index"].item() == 2_000
    assert subset[149]["action_is_pad"].tolist() == [False] * 3 + [True] * 9


def test_copies_of_a_dataset_share_its_cache_and_a_changed_one_gets_its_own(state_dataset: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    first = LeRobotDataset(state_dataset, keys=STATE)
    copy = shutil.copytree(state_dataset, tmp_path / "copy")  # copy2: the same sizes and modification times
    builds: list[str] = []
    real_entry = cache_module.entry

    def entry(root, name, key, build):  # noqa: ANN001, ANN202
        return real_entry(root, name, key, lambda folder: (builds.append(name), build(folder)))

    monkeypatch.setattr(cache_module, "entry", entry)
    second = LeRobotDataset(copy, keys=STATE)
    assert second.cache_dir == first.cache_dir and builds == []
    for name in ("data", "meta"):  # another revision of the dataset in the same folder
        shutil.rmtree(copy / name)
    write_state_dataset(copy, num_frames=2_050, episode_length=100, num_files=3, seed=1)
    changed = LeRobotDataset(copy, CHUNK, keys=STATE)
    assert changed.cache_dir != first.cache_dir and sorted(name.split("-")[0] for name in builds) == [
        "episodes", "frames"]
    _check_items(changed, _expected(copy), [0, 150, 2_049])
    _check_items(LeRobotDataset(state_dataset, CHUNK, keys=STATE), _expected(state_dataset), [0, 150, 2_049])


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
    dataset = LeRobotDataset(state_dataset, keys=STATE)
    entry = next(dataset.cache_dir.glob("frames-*"))
    manifest = json.loads((entry / MANIFEST).read_text())
    (entry / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))  # written by another version
    with pytest.warns(StaleCacheWarning, match=r"does not match what this run reads \(stale\); rebuilding it"):
        dataset = LeRobotDataset(state_dataset, CHUNK, keys=STATE)
    _check_items(dataset, _expected(state_dataset), [0, 150, 2_049])


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_cache_is_rebuilt_with_a_warning(state_dataset: Path, damage: str) -> None:
    entry = next(LeRobotDataset(state_dataset, keys=STATE).cache_dir.glob("frames-*"))
    column = entry / "action.npy"
    if damage == "truncate":
        os.truncate(column, column.stat().st_size // 2)  # as a disk that filled up mid-write
    else:
        column.unlink()
    with pytest.warns(StaleCacheWarning, match=r"action\.npy .*\(truncated\); rebuilding it"):
        dataset = LeRobotDataset(state_dataset, CHUNK, keys=STATE)
    _check_items(dataset, _expected(state_dataset), [0, 1_999, 2_049])
    json.loads((entry / "manifest.json").read_text())  # whole again


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
    kept = sorted(path.name for path in dataset.cache_dir.glob("*permutation-*"))
    assert kept == ["permutation-s3-n2050-e3", "permutation-s3-n2050-e4"]  # nothing else left behind


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


def test_the_shipped_pusht_slice_caches_under_the_user_cache_folder(user_cache: Path) -> None:
    before = _tree(PUSHT_SLICE)
    dataset = LeRobotDataset(PUSHT_SLICE, keys=["observation.state", "action"])
    assert dataset.cache_dir.parent == user_cache / "datasets-cache"
    assert _tree(PUSHT_SLICE) == before  # the package's files stay what the wheel ships


def test_the_dataset_cache_variable_moves_only_the_cache(state_dataset: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache_module.CACHE_DIR_ENV, str(tmp_path / "scratch"))
    dataset = LeRobotDataset(state_dataset, keys=STATE)
    assert dataset.cache_dir == tmp_path / "scratch" / dataset.fingerprint()


def test_a_file_system_without_flock_still_builds_and_reads(state_dataset: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(handle, operation):  # noqa: ANN001, ANN202  (Lustre mounted without -o flock)
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(cache_module.fcntl, "flock", refused)
    _check_items(LeRobotDataset(state_dataset, CHUNK, keys=STATE), _expected(state_dataset), [0, 2_049])
    _check_items(LeRobotDataset(state_dataset, CHUNK, keys=STATE), _expected(state_dataset), [7])


_NO_LOCK = """
import contextlib, os, sys, time
from pathlib import Path
from lerobot_mg.data import cache
from lerobot_mg.data import LeRobotDataset


@contextlib.contextmanager
def no_lock(root, name):  # two nodes on a shared file system whose locks do not reach each other
    yield False


cache.machine_lock = no_lock
real_entry = cache.entry
me, other = sys.argv[2], sys.argv[3]
signals = Path(os.environ["SIGNALS"])


def entry(root, name, key, build):
    def both_building(folder):
        kind = name.split("-")[0]
        (signals / f"{me}-{kind}").touch()
        while not (signals / f"{other}-{kind}").exists():  # each build starts before either publishes
            time.sleep(0.01)
        build(folder)
        (folder / "built_by").write_text(me)
    return real_entry(root, name, key, both_building)


cache.entry = entry
dataset = LeRobotDataset(sys.argv[1], keys=["observation.state", "action"])
print(dataset._frames.folder, (dataset._frames.folder / "built_by").read_text(),
      float(dataset[777]["action"].sum()), len(dataset))
"""


def test_processes_without_a_working_lock_building_at_once_read_one_winner(state_dataset: Path,
                                                                           tmp_path: Path, user_cache: Path) -> None:
    """Two real processes build the same entries at the same time with no lock between them: one rename wins, the
    other process reads the winner's entry and discards its own; nothing is left half-built."""
    script = tmp_path / "no_lock.py"
    script.write_text(_NO_LOCK)
    signals = tmp_path / "signals"
    signals.mkdir()
    env = clean_env({"SIGNALS": str(signals), "LEROBOT_MG_CACHE": str(user_cache)})
    processes = [subprocess.Popen([sys.executable, str(script), str(state_dataset), me, other], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for me, other in (("a", "b"), ("b", "a"))]
    outputs = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=180)
        finally:
            process.kill()
        assert process.returncode == 0, err
        assert "StaleCacheWarning" not in err, err
        outputs.append(out.split())
    assert sorted(path.name for path in signals.iterdir()) == ["a-episodes", "a-frames", "b-episodes", "b-frames"]
    assert outputs[0] == outputs[1], outputs  # the same folder, built by the same winner, the same items
    root = Path(outputs[0][0]).parent
    assert sorted(path.name.split("-")[0] for path in root.iterdir()) == ["episodes", "frames"]  # no temporaries
    _check_items(LeRobotDataset(state_dataset, CHUNK, keys=STATE), _expected(state_dataset), [777])


def _age(path: Path, days: float) -> None:
    stamp = time.time() - days * 86400
    for item in [path, *path.rglob("*")]:
        os.utime(item, (stamp, stamp))


def test_clean_keeps_what_starts_use_and_removes_the_rest(state_dataset: Path, user_cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = LeRobotDataset(state_dataset, keys=STATE)
    root = dataset.cache_dir
    used, unused = next(root.glob("frames-*")), root / "episodes"
    _age(used, 40)
    _age(unused, 40)
    LeRobotDataset(state_dataset, keys=STATE)  # a start opens episodes and frames again: both used now
    old = LeRobotDataset(state_dataset, keys=["observation.state"])  # another column set: its own entry
    other_columns = next(path for path in root.glob("frames-*") if path != used)
    _age(other_columns, 31)
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    killed_here = root / f".frames-x.building-{host}-{dead}-abc123"
    elsewhere_fresh = root / ".frames-x.building-node17-4242-def456"
    elsewhere_old = root / ".frames-x.old-node17-4243-ghi789"
    for folder in (killed_here, elsewhere_fresh, elsewhere_old):
        (folder / "action.npy").parent.mkdir()
        (folder / "action.npy").write_bytes(b"x")
    _age(elsewhere_old, 2)
    locks = sorted((root.parent / "locks").iterdir())
    assert locks
    cleaned = cache_module.clean()
    assert cleaned.unused == (other_columns,)
    assert sorted(cleaned.abandoned) == sorted([killed_here, elsewhere_old])
    assert sorted(path.name for path in root.iterdir()) == sorted(["episodes", used.name, elsewhere_fresh.name])
    assert sorted((root.parent / "locks").iterdir()) == locks  # lock files are never deleted
    del old
    monkeypatch.setenv(cache_module.KEEP_DAYS_ENV, "0.5")  # a shorter retention, by the environment
    _age(used, 1)
    assert cache_module.clean().unused == (used,)
    _check_items(LeRobotDataset(state_dataset, CHUNK, keys=STATE), _expected(state_dataset), [3])  # built again


@pytest.mark.parametrize("value", ["0", "-1", "a week"])
def test_a_retention_that_is_no_positive_number_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache_module.KEEP_DAYS_ENV, value)
    with pytest.raises(ConfigError, match=rf"^LEROBOT_MG_CACHE_DAYS='{value}': must be a positive number of days"):
        cache_module.clean()
