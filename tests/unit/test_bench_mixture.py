"""scripts/bench_mixture.py compares the mixture's random reads with its sources' own readers: the comparison holds
only if both read the same frames, and the generated sources are kept between runs (20M frames take minutes)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lerobot_mg.policies.base import ACTION_DIM_PAD_KEY, SOURCE_INDEX_KEY
from tests.launch_utils import REPO


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/bench_mixture.py as `python scripts/bench_mixture.py` imports it (scripts/ on the path)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    return importlib.import_module("bench_mixture")


def test_sources_are_generated_once_and_the_readers_read_the_mixtures_frames(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench(monkeypatch)
    specs = bench.source_specs(4_001, 3)
    assert sum(spec.frames for spec in specs) == 4_001
    assert [(spec.dim, spec.fps) for spec in specs] == [(14, 50), (7, 30), (14, 50)]
    assert len({spec.name for spec in specs}) == 3
    (tmp_path / specs[1].name / "data").mkdir(parents=True)  # a source a killed run left without its info.json
    roots = bench.generate(tmp_path, specs)
    written = [(root / "meta" / "info.json").stat().st_mtime_ns for root in roots]
    assert bench.generate(tmp_path, specs) == roots
    assert [(root / "meta" / "info.json").stat().st_mtime_ns for root in roots] == written  # kept, not rewritten

    mixture = bench._open_mixture(roots)
    assert len(mixture) == 4_001 and mixture.features["action"]["shape"] == [14]
    indices = bench._sampler(mixture, 0, 1).permutation(0)[:200].tolist()
    seen = set()
    for index, (dataset, own_index) in zip(indices, bench.reader_frames(mixture, indices)):
        item, own = {key: value[0] for key, value in mixture.collate([mixture[index]]).items()}, dataset[own_index]
        source = int(item[SOURCE_INDEX_KEY])
        assert dataset is mixture.datasets[source]
        dim = own["action"].shape[-1]
        assert dim == specs[source].dim and item[ACTION_DIM_PAD_KEY].tolist() == [d >= dim for d in range(14)]
        assert torch.equal(item["action"][:, :dim], own["action"])
        assert torch.equal(item["observation.state"][:dim], own["observation.state"])
        assert int(item["index"]) == index and int(own["index"]) == own_index
        seen.add(source)
    assert seen == {0, 1, 2}
