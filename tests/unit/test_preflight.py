"""One start reads the dataset's metadata once and builds the meta-device policy once; the preflight builds the
dataset cache before any process group exists.

A real one-process run of the debug preset, in a process of its own that records every file it opens (Python's
audit hook sees each ``open``), every parquet read through pyarrow by path (which the audit hook does not see), and
every policy it constructs with the device its parameters were built on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from lerobot_mg.preflight import preflight
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.unit.test_config import VALID, _train_config

_PROBE = '''
import json, os, sys
import pyarrow.parquet as pq

opened, parquet_paths, built = [], [], []


def audit(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.fsdecode(args[0]))


sys.addaudithook(audit)
for name in ("read_table", "read_schema", "ParquetFile"):
    original = getattr(pq, name)

    def recorded(source, *rest, _original=original, **kwargs):
        if isinstance(source, (str, os.PathLike)):
            parquet_paths.append(os.fspath(source))
        return _original(source, *rest, **kwargs)

    setattr(pq, name, recorded)

from lerobot_mg.config.schema import POLICY_CONFIGS
from lerobot_mg.policies.registry import get_policy_class

POLICY_CLASSES = [get_policy_class(name) for name in POLICY_CONFIGS]
for policy_class in POLICY_CLASSES:
    def init(self, *args, _init=policy_class.__init__, **kwargs):
        _init(self, *args, **kwargs)
        if type(self) in POLICY_CLASSES:
            built.append(next(self.parameters()).device.type)

    policy_class.__init__ = init

from lerobot_mg.scripts_entry import train

try:
    train()
finally:
    with open(os.environ["PROBE_OUT"], "w") as out:
        json.dump({"opened": opened, "parquet_paths": parquet_paths, "built": built}, out)
'''


def test_a_start_reads_the_dataset_metadata_once_and_builds_the_meta_policy_once(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    record = tmp_path / "record.json"
    run_train([*TINY_RUN, f"dataset.root={PUSHT_SLICE}", "steps=2", f"output_dir={tmp_path / 'run'}"],
              script=probe, env={"PROBE_OUT": str(record)})
    seen = json.loads(record.read_text())
    meta = PUSHT_SLICE / "meta"
    episode_files = sorted(str(path) for path in (meta / "episodes").glob("chunk-*/file-*.parquet"))
    assert episode_files
    opened = [path for path in seen["opened"] if path.startswith(str(meta))]
    assert opened.count(str(meta / "info.json")) == 1, opened
    for path in episode_files:
        assert opened.count(path) == 1, opened
    assert not [path for path in seen["parquet_paths"] if path.startswith(str(meta / "episodes"))]
    # One policy on the meta device (the checks and the memory plan), one with memory (the one that trains).
    assert seen["built"] == ["meta", "cpu"], seen["built"]


def test_the_preflight_builds_the_dataset_cache_before_any_process_group_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The training episodes' entries (and the validation episodes') exist when the preflight returns, built with a
    progress line per column; the next start opens them without building."""
    monkeypatch.setenv("LEROBOT_MG_CACHE", str(tmp_path / "user_cache"))
    monkeypatch.delenv("LEROBOT_MG_DATASET_CACHE", raising=False)
    cfg = _train_config([*VALID, "dataset.val_episodes=1"])
    with caplog.at_level(logging.INFO, logger="lerobot_mg.data"):
        checked = preflight(cfg, world_size=1)
    assert not torch.distributed.is_initialized()
    data = checked.train_data
    assert data is not None and data.episode_indices == checked.split.train
    assert data.cache_dir == tmp_path / "user_cache" / "datasets-cache" / checked.dataset.fingerprint
    built = [record.getMessage() for record in caplog.records if record.getMessage().startswith("dataset cache:")]
    frames = sorted(data.cache_dir.glob("frames-*"))
    assert len(frames) == 1  # the slice's one data file holds the training and the held-out episodes
    for folder in frames:
        assert f"dataset cache: building {folder}" in built, built
    assert any(line.startswith("dataset cache: column 2/7 'observation.state' of 1 data files") for line in built)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lerobot_mg.data"):
        preflight(cfg, world_size=1)
    assert not [record for record in caplog.records if "building" in record.getMessage()]
