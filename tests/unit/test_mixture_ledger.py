"""A dataset mixture in the run's accounting: the facts of its sources, what each interval drew from each source
(written by the real RunTracker, read back by read_ledger), the banner, and lerobot-mg-compare's per-source exposure
and its refusal to call runs on different mixtures comparable."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lerobot_mg.accounting.compare import (
    STREAM_FACTS,
    DataMismatch,
    check_resume,
    compare_runs,
    source_exposure,
)
from lerobot_mg.accounting.ledger import LEDGER_FILENAME, read_ledger
from lerobot_mg.accounting.report import format_markdown, format_text
from lerobot_mg.config.choices import MixtureStats
from lerobot_mg.config.schema import LoggingConfig, TrainConfig, WandbConfig
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation, ParallelDims, Topology
from lerobot_mg.policies.act import ACTConfig
from lerobot_mg.run_facts import (
    CodeRevision,
    FactChange,
    MixtureChange,
    MixtureDifference,
    Progress,
    ResumeCause,
    RunFacts,
    from_dict,
    mixture_differences,
)
from lerobot_mg.scripts_entry import compare_runs as compare_main
from lerobot_mg.step import StepLogs
from lerobot_mg.tracking import RunTracker, print_banner

# The global batch of a loop step: 2 samples on each of 2 data-parallel ranks; 2 loop steps per update.
BATCH = BatchArithmetic(batch_size=2, dp_world_size=2, grad_accum_steps=2)
ALOHA = {"name": "aloha", "root": "/data/aloha", "repo_id": None, "revision": None, "fingerprint": "a1a1a1a1",
         "weight": 0.75, "num_frames": 300, "num_episodes": 6, "fps": 50}
PUSHT = {"name": "lerobot_pusht", "root": "/cache/lerobot/pusht", "repo_id": "lerobot/pusht", "revision": "v3.0",
         "fingerprint": "b2b2b2b2", "weight": 0.25, "num_frames": 100, "num_episodes": 4, "fps": 10}
MIXTURE = [ALOHA, PUSHT]
FACTS = RunFacts(
    batch=BATCH, topology=Topology(1, 2, 2), precision="fp32", checkpoint_format="safetensors",
    code_revision=CodeRevision("c" * 40, dirty=False), dataset_fingerprint="mixture:abcd",
    lr_schedule={"type": "constant", "lr": 1e-4},
    model={"total_params": 1000, "trainable_params": 1000, "base_model_path": None, "peft": None},
    rank_bytes=({"parameters": 4000},) * 2, mixture=MIXTURE,
)


def draws(step: int, mixture: list[dict], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The (source, episode) of each sample of loop step ``step``'s global batch, drawn by weight: what the
    mixture sampler tells the main process."""
    rng = np.random.default_rng([seed, step])
    sources = rng.choice(len(mixture), size=BATCH.samples_per_loop_step, p=[s["weight"] for s in mixture])
    episodes = np.array([rng.integers(mixture[s]["num_episodes"]) for s in sources])
    return sources, episodes


def expected_counts(steps: range, mixture: list[dict], seed: int = 0) -> dict[str, dict[str, int]]:
    """What an interval over ``steps`` must record, counted sample by sample."""
    samples: Counter[str] = Counter()
    episodes: dict[str, set[int]] = {source["name"]: set() for source in mixture}
    for step in steps:
        for source, episode in zip(*draws(step, mixture, seed)):
            samples[mixture[source]["name"]] += 1
            episodes[mixture[source]["name"]].add(int(episode))
    return {source["name"]: {"samples": samples[source["name"]], "episodes": len(episodes[source["name"]])}
            for source in mixture}


def tracker(run_dir: Path, facts: RunFacts, total_steps: int, progress: Progress, log_freq: int = 3) -> RunTracker:
    logging = LoggingConfig(wandb=WandbConfig(mode="disabled"), progress_bar=False)  # type: ignore[arg-type]
    return RunTracker(logging, log_freq, total_steps, facts, progress, ParallelDims.resolve(1, None, 1), run_dir,
                      torch.device("cpu"), {"job_name": "mixture"})


def train(run_tracker: RunTracker, until: int, mixture: list[dict] | None, seed: int = 0,
          checkpoint_at: tuple[int, ...] = ()) -> None:
    """The loop's calls into the tracker, without a model: drawn() then step_done() every loop step, and the
    tracker's checkpoint() where the loop saves."""
    while run_tracker.progress.step < until:
        step = run_tracker.progress.step + 1
        if mixture is not None:
            run_tracker.drawn(*draws(step, mixture, seed))
        logs = StepLogs()
        logs.losses = {"loss": torch.tensor(1.0 / step)}
        logs.synced, logs.lr = step % BATCH.grad_accum_steps == 0, 1e-4
        run_tracker.step_done(logs, torch.arange(BATCH.batch_size) + step, 0.0)
        if step in checkpoint_at:
            run_tracker.checkpoint()


def test_each_interval_records_the_draws_of_each_source(tmp_path: Path) -> None:
    # Log steps 3 and 6, a checkpoint at 5 (it ends an interval of its own) and the last step, 7.
    run_tracker = tracker(tmp_path, FACTS, total_steps=7, progress=Progress())
    train(run_tracker, 7, MIXTURE, checkpoint_at=(5,))
    run_tracker.close()
    intervals = read_ledger(tmp_path).intervals
    assert [interval.progress.step for interval in intervals] == [3, 5, 6, 7]
    for interval, steps in zip(intervals, (range(1, 4), range(4, 6), range(6, 7), range(7, 8))):
        assert interval.sources == expected_counts(steps, MIXTURE)
    # Every sample of every global batch is counted once: the sources add up to the samples seen.
    drawn = sum(counts["samples"] for i in intervals for counts in i.sources.values())
    assert drawn == intervals[-1].progress.samples_seen == BATCH.sample_presentations(7)
    assert (read_ledger(tmp_path).segments[0].start.facts.mixture == MIXTURE)  # the facts round-trip exactly
    line = json.loads((tmp_path / LEDGER_FILENAME).read_text().splitlines()[1])
    assert line["sources"]["lerobot_pusht"] == expected_counts(range(1, 4), MIXTURE)["lerobot_pusht"]


def test_a_resumed_run_continues_the_counts_from_its_checkpoint(tmp_path: Path) -> None:
    # An uninterrupted run, and one that crashed at step 7 and resumed from its step-4 checkpoint.
    whole = tracker(tmp_path / "whole", FACTS, 9, Progress())
    train(whole, 9, MIXTURE, checkpoint_at=(4,))
    whole.close()
    first = tracker(tmp_path / "resumed", FACTS, 9, Progress())
    train(first, 7, MIXTURE, checkpoint_at=(4,))
    first.close()  # a crash: the interval of steps 7 was never written
    resumed_facts = dataclasses.replace(FACTS, resumed_from="checkpoints/000004",
                                        continuation=Continuation.SAMPLE_EXACT, resume_cause=ResumeCause.REQUEUE)
    second = tracker(tmp_path / "resumed", resumed_facts, 9, Progress(4, BATCH.sample_presentations(4), 2))
    train(second, 9, MIXTURE)
    second.close()

    record, reference = read_ledger(tmp_path / "resumed"), read_ledger(tmp_path / "whole")
    assert [i.progress.step for i in record.segments[0].intervals] == [3, 4, 6]  # step 6's is superseded
    assert [(i.progress.step, i.sources) for i in record.intervals] == [
        (i.progress.step, i.sources) for i in reference.intervals]
    assert [i.progress.step for i in record.intervals] == [3, 4, 6, 9]
    assert record.intervals[-1].sources == expected_counts(range(7, 10), MIXTURE)
    exposure = source_exposure(record)
    assert exposure == source_exposure(reference)
    total = expected_counts(range(1, 10), MIXTURE)
    assert [(e.name, e.samples, e.weights) for e in exposure] == [
        ("aloha", total["aloha"]["samples"], (0.75,)), ("lerobot_pusht", total["lerobot_pusht"]["samples"], (0.25,))]
    assert sum(e.samples for e in exposure) == BATCH.sample_presentations(9)
    assert exposure[0].share == total["aloha"]["samples"] / BATCH.sample_presentations(9)


def test_a_single_dataset_run_records_no_sources_and_draws_are_checked(tmp_path: Path) -> None:
    single = dataclasses.replace(FACTS, mixture=None, dataset_fingerprint="embedded:abc")
    run_tracker = tracker(tmp_path / "single", single, 3, Progress())
    with pytest.raises(ValueError, match="this run's facts have no mixture"):
        run_tracker.drawn(*draws(1, MIXTURE))
    train(run_tracker, 3, None)
    run_tracker.close()
    (interval,) = read_ledger(tmp_path / "single").intervals
    assert interval.sources == {} and source_exposure(read_ledger(tmp_path / "single")) == ()

    run_tracker = tracker(tmp_path / "mixture", FACTS, 3, Progress())
    sources, episodes = draws(1, MIXTURE)
    with pytest.raises(ValueError, match=r"each of the 4 samples of a loop step's global batch, got shapes \(2,\)"):
        run_tracker.drawn(sources[:2], episodes[:2])  # one rank's micro-batch is not the global batch
    with pytest.raises(ValueError, match=r"source positions must lie in \[0, 2\)"):
        run_tracker.drawn(sources + 2, episodes)
    run_tracker.close()


def test_ledgers_written_before_mixtures_still_read(tmp_path: Path) -> None:
    run_tracker = tracker(tmp_path / "old", dataclasses.replace(FACTS, mixture=None), 3, Progress())
    train(run_tracker, 3, None)
    run_tracker.close()
    path = tmp_path / "old" / LEDGER_FILENAME
    start, interval = (json.loads(line) for line in path.read_text().splitlines())
    del start["facts"]["mixture"], interval["sources"]  # as an older lerobot_mg wrote them
    path.write_text(json.dumps(start) + "\n" + json.dumps(interval) + "\n")
    record = read_ledger(tmp_path / "old")
    assert record.segments[0].start.facts.mixture is None and record.intervals[0].sources == {}
    assert from_dict(RunFacts, {k: v for k, v in start["facts"].items()}).mixture is None
    comparison = compare_runs([record, record])
    assert comparison.comparability.comparable and all(run.exposure == () for run in comparison.runs)
    assert not any(name.startswith("samples from") for name, _ in comparison.table)


def test_collect_records_the_sources_as_given() -> None:
    sources = [dict(source) for source in MIXTURE]
    facts = RunFacts.collect(TrainConfig(policy=ACTConfig()), ParallelDims.resolve(1, None, 1),
                             dataset_fingerprint="mixture:abcd", lr_schedule={}, model={}, rank_bytes=[],
                             resumed=None, resume_cause=None, mixture=sources)
    assert facts.mixture == MIXTURE
    sources[0]["weight"] = 0.0  # the facts hold their own copy: recorded once, never changed behind them
    assert facts.mixture[0]["weight"] == 0.75
    assert RunFacts.collect(TrainConfig(policy=ACTConfig()), ParallelDims.resolve(1, None, 1),
                            dataset_fingerprint="embedded:abc", lr_schedule={}, model={}, rank_bytes=[],
                            resumed=None, resume_cause=None).mixture is None


def test_a_resume_that_changes_the_mixture_changes_the_stream() -> None:
    assert "mixture" in STREAM_FACTS
    reweighted = dataclasses.replace(FACTS, mixture=[{**ALOHA, "weight": 0.5}, {**PUSHT, "weight": 0.5}])
    (change,) = reweighted.changes_since(FACTS)
    assert change == FactChange("mixture", MIXTURE, reweighted.mixture)
    assert change.describe("at resume (step 20)") == (
        "mixture changed at resume (step 20): source aloha weight 75 % -> 50 %; "
        "source lerobot_pusht weight 25 % -> 50 %")
    # Another source, another revision of one, or another order: each changes the stream.
    other = {**PUSHT, "name": "other", "fingerprint": "c3c3c3c3"}
    assert mixture_differences(MIXTURE, [ALOHA, other], ordered=True) == (
        MixtureDifference(MixtureChange.REMOVED, "lerobot_pusht", PUSHT),
        MixtureDifference(MixtureChange.ADDED, "other", None, other))
    regenerated = dataclasses.replace(FACTS, mixture=[ALOHA, {**PUSHT, "fingerprint": "d4d4d4d4", "num_frames": 90}])
    assert regenerated.changes_since(FACTS)[0].describe("here") == (
        "mixture changed here: source lerobot_pusht data b2b2b2b2 (100 frames, 4 episodes) -> d4d4d4d4 (90 frames, "
        "4 episodes)")
    swapped = dataclasses.replace(FACTS, mixture=[PUSHT, ALOHA])
    assert [d.change for d in mixture_differences(FACTS.mixture, swapped.mixture, ordered=True)] == [
        MixtureChange.MOVED, MixtureChange.MOVED]
    assert mixture_differences(FACTS.mixture, swapped.mixture, ordered=False) == ()  # the same distribution
    # Read from another directory (a download, then the cache), the same data: no change.
    moved = dataclasses.replace(FACTS, mixture=[{**ALOHA, "root": "/elsewhere"}, {**PUSHT, "revision": "main"}])
    assert moved.changes_since(FACTS) == ()
    assert "mixture: aloha 75 % + lerobot_pusht 25 %" in FACTS.describe()


def write_run(run_dir: Path, facts: RunFacts, steps: int, seed: int = 0, resume_at: int | None = None,
              resumed_facts: RunFacts | None = None) -> None:
    """A run through the real tracker; ``resume_at``: stop after the checkpoint at that step, then resume with
    ``resumed_facts``."""
    first = tracker(run_dir, facts, steps, Progress(), log_freq=4)
    train(first, resume_at or steps, facts.mixture, seed, checkpoint_at=(resume_at,) if resume_at else ())
    first.close()
    if resume_at is not None and resumed_facts is not None:
        after = dataclasses.replace(resumed_facts, resumed_from=f"checkpoints/{resume_at:06d}",
                                    continuation=Continuation.SAMPLE_EXACT, resume_cause=ResumeCause.REQUESTED)
        progress = Progress(resume_at, BATCH.sample_presentations(resume_at), BATCH.optimizer_updates(resume_at))
        second = tracker(run_dir, after, steps, progress, log_freq=4)
        train(second, steps, after.mixture, seed)
        second.close()


def test_compare_shows_exposure_per_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "seed0", FACTS, 12, seed=0)
    write_run(tmp_path / "seed1", FACTS, 12, seed=1)
    comparison = compare_runs([read_ledger(tmp_path / "seed0"), read_ledger(tmp_path / "seed1")])
    assert comparison.comparability.comparable and comparison.comparability.differences == ()
    rows = dict(comparison.table)
    for run, seed in zip(comparison.runs, (0, 1)):
        total = expected_counts(range(1, 13), MIXTURE, seed)
        assert [(e.name, e.samples) for e in run.exposure] == [(name, total[name]["samples"]) for name in total]
    aloha = comparison.runs[0].exposure[0]
    assert rows["samples from aloha (total)"][0] == (
        f"{aloha.samples:,} = {100 * aloha.samples / 48:.4g} % (weight 75 %)")
    text = format_text(comparison, None)
    assert "comparable: yes, every run trained on the same data: mixture:abcd = mixture aloha 75 % + " \
           "lerobot_pusht 25 %\n" in text
    assert "samples from lerobot_pusht (total)" in text

    assert compare_main([str(tmp_path / "seed0"), str(tmp_path / "seed1"), "json=true",
                         f"out={tmp_path / 'out'}"]) == 0
    payload = json.loads(capsys.readouterr().out)["comparison"]
    assert payload["comparability"] == {"comparable": True, "differences": [],
                                        "data": ["mixture:abcd = mixture aloha 75 % + lerobot_pusht 25 %"] * 2}
    assert [e["name"] for e in payload["runs"][0]["exposure"]] == ["aloha", "lerobot_pusht"]
    assert "**comparable: yes" in (tmp_path / "out" / "report.md").read_text()


def test_runs_on_different_mixtures_are_not_comparable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "base", FACTS, 8)
    reweighted = dataclasses.replace(FACTS, mixture=[{**ALOHA, "weight": 0.5}, {**PUSHT, "weight": 0.5}])
    write_run(tmp_path / "reweighted", reweighted, 8)
    third = {**PUSHT, "name": "third", "fingerprint": "e5e5e5e5", "weight": 0.2}
    widened = dataclasses.replace(FACTS, mixture=[{**ALOHA, "weight": 0.6}, {**PUSHT, "weight": 0.2}, third])
    write_run(tmp_path / "widened", widened, 8)
    records = [read_ledger(tmp_path / name) for name in ("base", "reweighted", "widened")]

    verdict = compare_runs(records[:2]).comparability
    assert not verdict.comparable
    (difference,) = verdict.differences
    assert (difference.mismatch, difference.run, difference.reference) == (DataMismatch.MIXTURE, "reweighted", "base")
    assert difference.sources == (MixtureDifference(MixtureChange.WEIGHT, "aloha", 0.75, 0.5),
                                  MixtureDifference(MixtureChange.WEIGHT, "lerobot_pusht", 0.25, 0.5))
    text = format_text(compare_runs(records[:2]), None)
    assert ("comparable: NO, the runs did not train on the same data, so their curves say nothing about the rest:\n"
            "  mixture differs between runs, base -> reweighted: source aloha weight 75 % -> 50 %; source "
            "lerobot_pusht weight 25 % -> 50 %\n") in text

    comparison = compare_runs([records[0], records[2]])
    (difference,) = comparison.comparability.differences
    assert [(d.change, d.source) for d in difference.sources] == [
        (MixtureChange.WEIGHT, "aloha"), (MixtureChange.WEIGHT, "lerobot_pusht"), (MixtureChange.ADDED, "third")]
    assert dict(comparison.table)["samples from third (total)"][0] == "-"  # base never drew from it
    assert "source third added (20 % of the draws)" in format_markdown(comparison, None, None)

    # Same names and weights, another revision of one source's data.
    regenerated = dataclasses.replace(FACTS, mixture=[ALOHA, {**PUSHT, "fingerprint": "f6f6f6f6"}])
    write_run(tmp_path / "regenerated", regenerated, 8)
    (difference,) = compare_runs([records[0], read_ledger(tmp_path / "regenerated")]).comparability.differences
    assert [(d.change, d.source) for d in difference.sources] == [(MixtureChange.DATA, "lerobot_pusht")]

    # A single dataset against a mixture: the datasets differ.
    single = dataclasses.replace(FACTS, mixture=None, dataset_fingerprint="embedded:abc")
    write_run(tmp_path / "single", single, 8)
    (difference,) = compare_runs([read_ledger(tmp_path / "single"), records[0]]).comparability.differences
    assert (difference.mismatch, difference.fingerprints) == (DataMismatch.DATASET, ("embedded:abc", "mixture:abcd"))
    assert difference.describe() == "dataset differs between runs: single embedded:abc, base mixture:abcd"

    assert compare_main([str(tmp_path / "base"), str(tmp_path / "reweighted"), "json=true",
                         f"out={tmp_path / 'out'}"]) == 0
    payload = json.loads(capsys.readouterr().out)["comparison"]["comparability"]
    assert payload["comparable"] is False
    assert payload["differences"][0]["mismatch"] == "mixture"
    assert payload["differences"][0]["sources"][0] == {"change": "weight", "source": "aloha", "before": 0.75,
                                                       "after": 0.5}


def test_the_same_sources_in_another_order_are_comparable(tmp_path: Path) -> None:
    """Two mixtures are compared source by source only: the same sources and weights listed in another order draw
    the same distribution, though the dataset fingerprint (a function of the sources' order) differs."""
    write_run(tmp_path / "base", FACTS, 8)
    swapped = dataclasses.replace(FACTS, mixture=[PUSHT, ALOHA], dataset_fingerprint="mixture:dcba")
    write_run(tmp_path / "swapped", swapped, 8)
    records = [read_ledger(tmp_path / name) for name in ("base", "swapped")]
    assert [r.segments[0].start.facts.dataset_fingerprint for r in records] == ["mixture:abcd", "mixture:dcba"]
    verdict = compare_runs(records).comparability
    assert verdict.comparable and verdict.differences == ()
    # Another order and another source's data: the source is named, not the fingerprints.
    regenerated = dataclasses.replace(swapped, mixture=[{**PUSHT, "fingerprint": "f6f6f6f6"}, ALOHA])
    write_run(tmp_path / "regenerated", regenerated, 8)
    (difference,) = compare_runs([records[0], read_ledger(tmp_path / "regenerated")]).comparability.differences
    assert difference.mismatch is DataMismatch.MIXTURE
    assert [(d.change, d.source) for d in difference.sources] == [(MixtureChange.DATA, "lerobot_pusht")]


def test_a_run_that_changed_its_mixture_at_a_resume_is_not_comparable(tmp_path: Path) -> None:
    reweighted = dataclasses.replace(FACTS, mixture=[{**ALOHA, "weight": 0.5}, {**PUSHT, "weight": 0.5}])
    write_run(tmp_path / "changed", FACTS, 8, resume_at=4, resumed_facts=reweighted)
    write_run(tmp_path / "steady", FACTS, 8)
    comparison = compare_runs([read_ledger(tmp_path / "changed"), read_ledger(tmp_path / "steady")])
    (difference,) = comparison.comparability.differences
    assert (difference.mismatch, difference.run, difference.loop_step) == (DataMismatch.CHANGED, "changed", 4)
    assert difference.describe() == ("changed: the training data changed at its resume at loop step 4: source "
                                     "aloha weight 75 % -> 50 %; source lerobot_pusht weight 25 % -> 50 %")
    changed = comparison.runs[0]
    assert [e.weights for e in changed.exposure] == [(0.75, 0.5), (0.25, 0.5)]
    assert dict(comparison.table)["samples from aloha (total)"][0].endswith("(weight 75 % -> 50 %)")
    # The resume conditions say what changed, as for any fact that changes the sample stream.
    assert ("FLAG: mixture changed at resume (step 4): source aloha weight 75 % -> 50 %; source lerobot_pusht "
            "weight 25 % -> 50 %") in format_text(comparison, None)
    # Its loaders delivered the reference's indices, yet the resume check names the change of the stream's data.
    check = check_resume(read_ledger(tmp_path / "changed"), read_ledger(tmp_path / "steady"))
    assert check.boundaries[0].message.endswith(
        "match the reference; mixture changed at resume (step 4): source aloha weight 75 % -> 50 %; source "
        "lerobot_pusht weight 25 % -> 50 %")
    # Both segments' draws count: the first four steps at the old weights, the rest at the new.
    total = {name: expected_counts(range(1, 5), MIXTURE)[name]["samples"]
             + expected_counts(range(5, 9), reweighted.mixture)[name]["samples"] for name in ("aloha", "lerobot_pusht")}
    assert [(e.name, e.samples) for e in changed.exposure] == list(total.items())


def test_the_banner_prints_each_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = TrainConfig(policy=ACTConfig(), job_name="mix")
    # dataset.sources / dataset.stats as dataset=mixture sets them: the first weight set, the second the default.
    cfg.dataset.sources = [SimpleNamespace(weight=3.0), SimpleNamespace(weight=None)]  # type: ignore[attr-defined]
    cfg.dataset.stats = MixtureStats.per_source
    print_banner(cfg, FACTS, None, tmp_path, Progress())  # type: ignore[arg-type]  # a mixture's are in the facts
    out = capsys.readouterr().out
    assert "dataset: a mixture of the sources below" in out
    assert ("  mixture sources: 2, 400 frames, 10 episodes; normalised with per-source statistics, each sample with "
            "its own source's (dataset.stats=per_source)\n") in out
    assert "    [0] aloha: 75 % of draws (weight set), 300 frames, 6 episodes, 50 fps  (/data/aloha, a1a1a1a1)\n" in out
    assert ("    [1] lerobot_pusht: 25 % of draws (its share of frames), 100 frames, 4 episodes, 10 fps  "
            "(lerobot/pusht, b2b2b2b2)\n") in out
    assert "  mixture: aloha 75 % + lerobot_pusht 25 %\n" in out  # the facts' own line

    # The defaults (merged statistics), and sources the config does not list (the facts' alone are printed).
    print_banner(TrainConfig(policy=ACTConfig()), FACTS, None, tmp_path, Progress())  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert ("  mixture sources: 2, 400 frames, 10 episodes; normalised with merged statistics, one normaliser over "
            "every source (LeRobot's aggregate_stats) (dataset.stats=merged)\n") in out
    assert "    [0] aloha: 75 % of draws, 300 frames, 6 episodes, 50 fps  (/data/aloha, a1a1a1a1)\n" in out
