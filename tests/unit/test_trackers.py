"""A run directory is one W&B run and one trackio run however often it starts.

One run with wandb (offline) and trackio both on, the guide's ``--trackio.enable=true`` spelling, a checkpoint at
step 4, then a resume to step 8 from it. wandb's offline run directories are read back with the protobuf records
wandb itself writes; trackio's local store (a temporary ``TRACKIO_DIR``) with trackio's own reading API. Nothing
reaches the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from lerobot_mg.config.loading import normalize_argv
from lerobot_mg.config.schema import TrackioConfig
from lerobot_mg.distributed.trackers import TRACKER_RUN_FILENAME, TrackerRun, check_trackers, tracker_run
from lerobot_mg.errors import ConfigError
from lerobot_mg.launch.sweep import prepare_sweep_job
from tests.launch_utils import REPO, TINY_RUN, interval_metrics, run_train

pytest.importorskip("trackio")  # the trackio extra (make setup installs it)

PROJECT = "tracking_test"
GROUP = "sweep-7"
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "TRACKIO_DIR": ""}


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    """(run dir, trackio store, first start's output, resume's output)."""
    base = tmp_path_factory.mktemp("trackers")
    run_dir, store = base / "run", base / "trackio"
    env = {**OFFLINE, "TRACKIO_DIR": str(store)}
    overrides = [o for o in TINY_RUN if not o.startswith("logging.wandb")]
    first = run_train([*overrides, "steps=4", "log_freq=2", "checkpoint.save_freq=4", f"output_dir={run_dir}",
                       "logging.wandb.mode=offline", f"logging.wandb.group={GROUP}", "--trackio.enable=true",
                       f"--trackio.project={PROJECT}", f"trackio.group={GROUP}"], env=env, timeout=400)
    config = run_dir / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    second = run_train(["resume=true", f"config_path={config}", "steps=8"], env=env, timeout=400)
    return run_dir, store, first.stdout, second.stdout


def _wandb_records(path: Path):
    """The records of a ``run-<id>.wandb`` file: wandb's LevelDB-style log (a 7-byte header, 32 KiB blocks of
    chunks with a 7-byte header: crc32, length, type) of ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_segment(offline_dir: Path) -> tuple[str, str, list[int], dict[int, float]]:
    """(run id, group, history steps, loss by step) of one offline run directory."""
    (path,) = offline_dir.glob("run-*.wandb")
    run_id = group = ""
    steps, losses = [], {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, group = record.run.run_id, record.run.run_group
        elif kind == "history":
            steps.append(record.history.step.num)
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            losses[record.history.step.num] = items["loss"]
    return run_id, group, steps, losses


def test_a_resumed_run_continues_its_wandb_run(resumed_run: tuple[Path, Path, str, str]) -> None:
    run_dir, _, _, _ = resumed_run
    stored = json.loads((run_dir / TRACKER_RUN_FILENAME).read_text())
    segments = [_wandb_segment(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
    assert len(segments) == 2  # one offline directory per start, of one W&B run (`wandb sync` joins them)
    assert {(run_id, group) for run_id, group, _, _ in segments} == {(stored["id"], GROUP)}
    assert [steps for _, _, steps, _ in segments] == [[2, 4], [6, 8]]  # the resumed start goes on from step 4
    ledger = {m["step"]: m["loss"] for m in interval_metrics(run_dir)}
    assert {**segments[0][3], **segments[1][3]} == ledger


def test_a_resumed_run_continues_its_trackio_run_with_the_ledgers_metrics(
        resumed_run: tuple[Path, Path, str, str]) -> None:
    run_dir, store, first, second = resumed_run
    name = TrackerRun(**json.loads((run_dir / TRACKER_RUN_FILENAME).read_text())).trackio_name
    assert f"trackio: created run {name} of project {PROJECT} in {store}" in first
    assert f"trackio: resumed run {name} of project {PROJECT} in {store}" in second
    # Read back in a fresh process: trackio reads TRACKIO_DIR once, at import.
    reader = f"""
import json, trackio
runs = list(trackio.Api().runs({PROJECT!r}))
config = runs[0].config
logs = trackio.SQLiteStorage.get_logs({PROJECT!r}, runs[0].name)
print(json.dumps({{"runs": [r.name for r in runs], "group": config.get("_Group"),
                   "facts": config["run_facts"]["batch"], "logs": logs}}, default=str))
"""
    read = subprocess.run([sys.executable, "-c", reader], env={**os.environ, "TRACKIO_DIR": str(store),
                                                               "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, check=True, cwd=REPO)
    found = json.loads(read.stdout.strip().splitlines()[-1])
    assert found["runs"] == [name]  # one run across both starts
    assert found["group"] == GROUP and found["facts"]["effective_batch_size"] == 8
    ledger = interval_metrics(run_dir)
    keys = ("loss", "lr", "samples_seen", "optimizer_updates", "samples_per_s", "data_wait_s", "grad_norm")
    assert [row["step"] for row in found["logs"]] == [m["step"] for m in ledger] == [2, 4, 6, 8]
    for row, m in zip(found["logs"], ledger, strict=True):
        assert {k: row[k] for k in keys} == {k: m[k] for k in keys}, row["step"]


def test_the_guides_trackio_flag_is_an_override() -> None:
    assert normalize_argv(["--trackio.enable=true", "--trackio.project=p"]) == ["trackio.enable=true",
                                                                              "trackio.project=p"]


def test_the_tracker_run_is_created_once_per_run_directory(tmp_path: Path) -> None:
    first = tracker_run(tmp_path, "act-run")
    assert tracker_run(tmp_path, "another-name") == first  # a later start keeps the stored id and name
    assert tracker_run(tmp_path / "other", "act-run").id != first.id
    assert not list(tmp_path.glob("*.tmp"))


def test_trackio_without_its_package_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else find_spec(name, *a))
    check_trackers(TrackioConfig(enable=False))  # off: nothing to import
    with pytest.raises(ConfigError, match=r"^trackio.enable=True: the trackio package is not installed. Fix: pip "):
        check_trackers(TrackioConfig(enable=True))


def test_a_sweep_point_logs_into_the_sweeps_group_in_both_trackers(tmp_path: Path) -> None:
    composed = OmegaConf.create({"output_dir": None, "resume": False, "config_path": None,
                                 "logging": {"wandb": {"group": None}}, "trackio": {"group": None}})
    hydra_cfg = OmegaConf.create({"mode": RunMode.MULTIRUN, "runtime": {"output_dir": str(tmp_path / "0")},
                                  "sweep": {"dir": str(tmp_path)}})
    prepared, job = prepare_sweep_job(composed, hydra_cfg)
    assert job is not None and job.run_dir == tmp_path / "0"
    assert prepared.logging.wandb.group == prepared.trackio.group == str(tmp_path)
