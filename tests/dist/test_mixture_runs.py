"""dataset=mixture on real ranks: two robots (an ALOHA-shaped dataset, 14-dim state and action, a top camera, 50 fps;
and the shipped PushT slice, 2-dim, its camera renamed to the top one, 10 fps) train experiment=aloha_pi0_tiny under
FSDP-2 with each sample normalised by its own source's statistics. A run stopped at its step-2 checkpoint and resumed
ends bit-identical to the uninterrupted one after the same samples; the ledger names each source with what every
interval drew from it, lerobot-mg-compare shows the exposure per source, and the checkpoint holds each source's
processor files beside the merged ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.checkpoint import layout as L
from lerobot_mg.processors import NormalizerStep, load_processors
from lerobot_mg.processors.mixture import load_source_processors
from lerobot_mg.scripts_entry import compare_runs as compare
from tests.dist.test_checkpoints import copy_run
from tests.dist.test_resume import assert_same_checkpoint, resume_args, update_digests
from tests.launch_utils import PUSHT_SLICE, run_train
from tests.vla_preset_aids import PRESET_TEST_OVERRIDES, shared_vla_dataset

pytestmark = pytest.mark.dist

STEPS = 4
SAVE_FREQ = 2
BATCH = 2  # per rank: a global batch of 4 on 2 ranks


def mixture_overrides(aloha: Path) -> list[str]:
    return [
        "experiment=aloha_pi0_tiny", "dataset=mixture",
        f"dataset.sources=[{{root: {aloha}, weight: 0.6}}, {{root: {PUSHT_SLICE}, weight: 0.4, "
        "rename_map: {observation.image: observation.images.top}}]",
        "dataset.stats=per_source", *PRESET_TEST_OVERRIDES,
    ]


@pytest.fixture(scope="module")
def aloha(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_vla_dataset(tmp_path_factory)


def test_a_two_robot_mixture_trains_sharded_resumes_bit_exact_and_is_accounted_per_source(
        aloha: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = tmp_path / "reference"
    proc = run_train([*mixture_overrides(aloha), "parallelism.dp_shard=2", f"batch_size={BATCH}", f"steps={STEPS}",
                      f"checkpoint.save_freq={SAVE_FREQ}", f"output_dir={reference}"], nproc=2, timeout=360)
    assert "topology: FSDP2: 2 shards (world size 2)" in proc.stdout, proc.stdout[-3000:]
    assert "mixture sources: 2, " in proc.stdout and "(dataset.stats=per_source)" in proc.stdout

    resumed = copy_run(reference, tmp_path / "resumed")
    proc = run_train(resume_args(resumed, SAVE_FREQ), nproc=2, timeout=360)
    assert f"sample offset {SAVE_FREQ * 2 * BATCH}" in proc.stdout, proc.stdout[-3000:]
    final = L.step_dir_name(STEPS)
    assert_same_checkpoint(L.checkpoints_root(resumed) / final, L.checkpoints_root(reference) / final)
    digests = update_digests(resumed, SAVE_FREQ)
    assert len(digests) == STEPS - SAVE_FREQ and digests == update_digests(reference, SAVE_FREQ)

    # The ledger: each interval (log_freq=1: each step) drew the global batch from the two sources, by name.
    for run in (reference, resumed):
        intervals = read_ledger(run).intervals
        assert [r.progress.step for r in intervals] == list(range(1, STEPS + 1))
        for record in intervals:
            assert set(record.sources) <= {aloha.name, PUSHT_SLICE.name}, record.sources
            assert sum(count["samples"] for count in record.sources.values()) == 2 * BATCH
            assert all(1 <= count["episodes"] <= count["samples"] for count in record.sources.values())
    assert [r.sources for r in read_ledger(resumed).intervals] == [r.sources for r in read_ledger(reference).intervals]

    # Compare: the same mixture, comparable, each source's exposure shown.
    assert compare([str(reference), str(resumed), f"out={tmp_path / 'report'}"]) == 0
    report = capsys.readouterr().out
    assert "comparable: yes" in report, report
    for name in (aloha.name, PUSHT_SLICE.name):
        assert f"samples from {name} (total)" in report, report

    # The checkpoint: the merged statistics in the default files, each source's own in its pair (padded to 14 dims).
    pretrained = L.checkpoints_root(reference) / final / "pretrained_model"
    merged = load_processors(pretrained)[0].step(NormalizerStep).stats
    pusht = load_source_processors(pretrained, PUSHT_SLICE.name)[0].step(NormalizerStep).stats
    aloha_own = load_source_processors(pretrained, aloha.name)[0].step(NormalizerStep).stats
    assert merged["action"]["mean"].shape == pusht["action"]["mean"].shape == (14,)
    assert not torch.equal(pusht["action"]["mean"][:2], merged["action"]["mean"][:2])
    own = json.loads((PUSHT_SLICE / "meta" / "stats.json").read_text())["action"]
    assert torch.allclose(pusht["action"]["mean"][:2], torch.tensor(own["mean"], dtype=torch.float32))
    assert torch.equal(pusht["action"]["mean"][2:], torch.zeros(12)) and torch.equal(pusht["action"]["std"][2:],
                                                                                      torch.ones(12))
    # Dimensions 2..13 only ALOHA has: merged, they are ALOHA's own.
    assert torch.allclose(merged["action"]["mean"][2:], aloha_own["action"]["mean"][2:])
