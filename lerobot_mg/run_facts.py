"""The facts of one start of a run, built once by train() and written with ``dataclasses.asdict`` wherever they go.

A learning curve can only be attributed to the code, data and layout recorded with it (docs/comparing-runs.md).
The banner prints ``RunFacts``; ``train_config.json`` (``run_facts``), every checkpoint's ``training_step.json``
and the ledger's start record (lerobot_mg/accounting) carry it; ``from_dict`` reads any of them back. What changed
at a resume is computed once, as typed ``FactChange``s that the start-up log and the comparison report render; how
two dataset mixtures differ, as typed ``MixtureDifference``s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import subprocess
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, Continuation, ParallelDims, Topology

T = TypeVar("T")
_REPO_DIR = Path(__file__).resolve().parents[1]  # the checkout this package runs from


@dataclass
class Progress:
    """Loop counters at the end of a loop step."""

    step: int = 0
    samples_seen: int = 0
    optimizer_updates: int = 0
    skipped_updates: int = 0  # fp16 overflow: the scaler skipped the optimizer step


@dataclass(frozen=True)
class CodeRevision:
    """The git commit a run started from and whether the tree was dirty; None where git cannot tell."""

    commit: str | None
    dirty: bool | None

    @classmethod
    def of_checkout(cls, repo_dir: Path = _REPO_DIR) -> CodeRevision:
        """Never raises. Untracked files count as dirty (a new module changes what runs); ignored ones do not."""

        def git(*args: str) -> str | None:
            try:
                done = subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                return None
            return done.stdout if done.returncode == 0 else None

        if git("rev-parse", "--is-inside-work-tree") is None:
            return cls(None, None)
        head, status = git("rev-parse", "--verify", "--quiet", "HEAD"), git("status", "--porcelain")
        return cls(head.strip() if head else None, None if status is None else bool(status.strip()))

    def describe(self) -> str:
        text = "unknown" if self.commit is None else self.commit[:12]
        return text + (" (dirty)" if self.dirty else " (dirty: unknown)" if self.dirty is None else "")


class ResumeCause(str, Enum):
    """Why a run resumed."""

    REQUESTED = "requested"  # resume=true config_path=... on the command line
    PREEMPTION = "preemption"  # the last attempt saved on the preemption/time-limit signal; the job was requeued
    REQUEUE = "requeue"  # SLURM restarted the job (node failure, scontrol requeue) from its last periodic checkpoint
    RELAUNCH = "relaunch"  # the same sweep job directory was launched again


@dataclass(frozen=True)
class FactChange:
    """One fact that differs from the start a run resumed."""

    name: str
    before: Any
    after: Any

    def describe(self, where: str) -> str:
        if self.name == "mixture":  # a list of sources: say which source changed, and how
            differences = mixture_differences(self.before, self.after, ordered=True)
            return f"mixture changed {where}: {'; '.join(d.describe() for d in differences)}"
        return f"{self.name.replace('_', ' ')} changed {where}: {describe(self.before)} -> {describe(self.after)}"


class MixtureChange(str, Enum):
    """How one source of a dataset mixture differs between two mixtures."""

    ADDED = "added"  # only the second mixture draws from it
    REMOVED = "removed"  # only the first one does
    DATA = "data"  # another dataset revision (fingerprint), or another selection of its frames or episodes
    WEIGHT = "weight"  # another probability of drawing from it
    MOVED = "moved"  # another position in dataset.sources: the same weights draw another sample stream


@dataclass(frozen=True)
class MixtureDifference:
    """One difference between two mixtures, for the source named ``source``; ``before`` and ``after``: the values
    that differ (a weight, ``{fingerprint, num_frames, num_episodes}``, a position, or the source's facts where it
    was added or removed)."""

    change: MixtureChange
    source: str
    before: Any = None
    after: Any = None

    def describe(self) -> str:
        if self.change is MixtureChange.ADDED:
            return f"source {self.source} added ({percent(self.after['weight'])} of the draws)"
        if self.change is MixtureChange.REMOVED:
            return f"source {self.source} removed (was {percent(self.before['weight'])} of the draws)"
        if self.change is MixtureChange.WEIGHT:
            return f"source {self.source} weight {percent(self.before)} -> {percent(self.after)}"
        if self.change is MixtureChange.MOVED:
            return f"source {self.source} moved from position {self.before} to {self.after} in dataset.sources"
        return f"source {self.source} data {describe_source_data(self.before)} -> {describe_source_data(self.after)}"


MIXTURE_DATA_KEYS = ("fingerprint", "num_frames", "num_episodes")  # what a source holds; where it was read does not
WEIGHT_TOLERANCE = 1e-9  # relative: weights that differ by rounding only are the same weight


def mixture_differences(before: Sequence[dict] | None, after: Sequence[dict] | None,
                        ordered: bool) -> tuple[MixtureDifference, ...]:
    """How the mixture ``after`` differs from ``before`` (``RunFacts.mixture``; None: a single dataset, no
    sources). Sources are matched by name and compared on their data (``MIXTURE_DATA_KEYS``: a source read from
    another directory or Hub revision with the same fingerprint is the same data) and their weight. ``ordered``:
    a source at another position counts too, as it does for the sample stream a resume continues (the draw is a
    function of the source positions); two runs' mixtures are the same distribution whatever the order."""
    old, new = ({source["name"]: (position, source) for position, source in enumerate(sources or ())}
                for sources in (before, after))
    differences = [MixtureDifference(MixtureChange.REMOVED, name, source) for name, (_, source) in old.items()
                   if name not in new]
    for name, (position, source) in new.items():
        if name not in old:
            differences.append(MixtureDifference(MixtureChange.ADDED, name, None, source))
            continue
        was_at, was = old[name]
        data_before, data_after = ({key: s.get(key) for key in MIXTURE_DATA_KEYS} for s in (was, source))
        if data_before != data_after:
            differences.append(MixtureDifference(MixtureChange.DATA, name, data_before, data_after))
        if not math.isclose(was["weight"], source["weight"], rel_tol=WEIGHT_TOLERANCE):
            differences.append(MixtureDifference(MixtureChange.WEIGHT, name, was["weight"], source["weight"]))
        if ordered and was_at != position:
            differences.append(MixtureDifference(MixtureChange.MOVED, name, was_at, position))
    return tuple(differences)


def percent(weight: float) -> str:
    """A weight (a probability) as a percentage: four significant digits, so weights that differ print apart."""
    return f"{100 * weight:.4g} %"


def describe_source_data(data: dict) -> str:
    return (f"{data.get('fingerprint')} ({data.get('num_frames')} frames, {data.get('num_episodes')} episodes)")


def describe_mixture(mixture: Sequence[dict]) -> str:
    """A mixture in one line: each source's name and weight, in ``dataset.sources`` order."""
    return " + ".join(f"{source['name']} {percent(source['weight'])}" for source in mixture)


@dataclass(frozen=True)
class RunFacts:
    batch: BatchArithmetic
    topology: Topology
    precision: str
    checkpoint_format: str
    code_revision: CodeRevision
    dataset_fingerprint: str
    lr_schedule: dict
    model: dict  # parameter counts, the base model path and PEFT settings (lerobot_mg.peft.build.describe_finetune)
    rank_bytes: tuple[dict, ...]  # what each rank holds: parameter bytes, trainable and total
    resumed_from: str | None = None  # the checkpoint this start resumed; None for a fresh start
    continuation: Continuation | None = None  # how exactly that resume continues the sample stream
    resume_cause: ResumeCause | None = None  # why it resumed
    # Where the dataset was read: root (the resolved directory), repo_id, revision (dataset.revision, as asked for),
    # commit (the Hub commit the files read were downloaded at; None when the directory records none) and how it was
    # found (root | cache | download); lerobot_mg.data.hub.DatasetSource.
    dataset_source: dict | None = None
    # A dataset mixture (dataset=mixture): one dict per source, in dataset.sources order, with its name, where it
    # was read (root, repo_id, revision), its data (fingerprint, num_frames, num_episodes, fps) and its weight (the
    # normalised probability of drawing from it). None: a single dataset.
    mixture: list[dict] | None = None
    # The model FLOPs of one training sample, forward + backward, counted once per start on the meta device without
    # activation recomputation (lerobot_mg.accounting.throughput.training_flops_per_sample); None: not counted.
    flops_per_sample: int | None = None
    # The device each rank trains on, which MFU is measured against: name (torch.cuda.get_device_name, or the device
    # type: cpu), precision (bf16 | fp16 | tf32 | fp32, the run's compute precision) and peak_flops (its dense peak
    # FLOP/s; None on a CPU or a GPU the table does not list: no MFU). None: not recorded (an older run).
    device: dict | None = None

    @classmethod
    def collect(cls, cfg: TrainConfig, dims: ParallelDims, *, dataset_fingerprint: str, lr_schedule: dict,
                model: dict, rank_bytes: Sequence[dict], resumed: tuple[Path, RunFacts] | None,
                resume_cause: ResumeCause | None, dataset_source: dict | None = None,
                mixture: Sequence[dict] | None = None, flops_per_sample: int | None = None,
                device: dict | None = None) -> RunFacts:
        """The facts of this start (the code revision is asked of git here, once per start); ``resumed``: the
        checkpoint this start continues and the facts of the start that wrote it; ``mixture``: the sources of a
        dataset mixture (``MixtureDataset.facts()``), None for a single dataset."""
        batch = BatchArithmetic(cfg.batch_size, dims.dp_world_size, cfg.accelerator.gradient_accumulation.steps)
        return cls(
            batch=batch, topology=dims.topology, precision=str(cfg.accelerator.mixed_precision),
            checkpoint_format=str(cfg.checkpoint.format), code_revision=CodeRevision.of_checkout(),
            dataset_fingerprint=dataset_fingerprint, lr_schedule=lr_schedule, model=model,
            rank_bytes=tuple(rank_bytes), resumed_from=None if resumed is None else str(resumed[0]),
            continuation=None if resumed is None else Continuation.of_resume(resumed[1].batch, batch),
            resume_cause=None if resumed is None else resume_cause, dataset_source=dataset_source,
            mixture=None if mixture is None else [dict(source) for source in mixture],
            flops_per_sample=flops_per_sample, device=device,
        )

    def changes_since(self, before: RunFacts) -> tuple[FactChange, ...]:
        """The facts that differ from ``before``'s (the start this one resumed). Where from, how exactly and why a
        start resumed differ by nature; the bytes per rank follow from the model and the topology. A mixture
        changes when a source is added, removed or moved, or its data or weight changes (``mixture_differences``),
        not when a source is read from another place. The FLOPs per sample follow from the model and the code."""
        compared = [f.name for f in fields(self) if f.name not in (
            "rank_bytes", "resumed_from", "continuation", "resume_cause", "flops_per_sample")]

        def changed(name: str) -> bool:
            if name == "device" and None in (before.device, self.device):
                return False  # a start of an older version did not record it
            if name == "mixture":
                return bool(mixture_differences(before.mixture, self.mixture, ordered=True))
            return _compared(before, name) != _compared(self, name)

        return tuple(FactChange(name, _compared(before, name), _compared(self, name)) for name in compared
                     if changed(name))

    def describe(self) -> list[str]:
        return [f"topology: {self.topology.describe()} (world size {self.topology.world_size})",
                f"batch: {self.batch.describe()}",
                f"precision: {self.precision}  checkpoint format: {self.checkpoint_format}",
                f"code: {self.code_revision.describe()}  dataset: {self.dataset_fingerprint}{self._source()}",
                f"lr schedule: {describe(self.lr_schedule)}",
                *([f"mixture: {describe_mixture(self.mixture)}"] if self.mixture is not None else []),
                f"model FLOPs per sample (forward + backward): {describe_count(self.flops_per_sample, 'FLOP')}  "
                f"device: {describe_device(self.device)}"]

    def _source(self) -> str:
        source = self.dataset_source
        if not source or (source.get("repo_id") is None and source.get("commit") is None):
            return ""
        commit = source.get("commit")
        at = f"@{commit[:12]}" if commit else " (commit unknown)"
        asked = f", revision {source['revision']}" if source.get("revision") else ""
        return f" ({source.get('repo_id') or 'a Hub download'}{at}{asked}, {source['how']}: {source['root']})"


def describe_count(count: float | None, unit: str) -> str:
    """``9.84 TFLOP``-style: a count in the largest SI prefix that leaves a number >= 1; ``not counted`` for None."""
    if count is None:
        return "not counted"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {prefix}{unit}"
    return f"{count:.3g} {unit}"


def describe_device(device: dict | None) -> str:
    """The device MFU is measured against, with its peak."""
    if device is None:
        return "not recorded"
    peak = device.get("peak_flops")
    if peak is not None:
        return f"{device['name']}, peak {describe_count(peak, 'FLOP/s')} {device['precision']}"
    if device["name"] == "cpu":
        return "cpu (no MFU)"
    return f"{device['name']} ({device['precision']}: not in the peak table, no MFU)"


def _compared(facts: RunFacts, name: str) -> Any:
    """A fact as a resume compares it: how a dataset was found (downloaded, then cached) is no change."""
    value = getattr(facts, name)
    if name == "dataset_source" and value is not None:
        return {key: item for key, item in value.items() if key != "how"}
    return value


def describe(value: Any) -> str:
    """A fact as text: its own description; an lr schedule as its type and ``key=value`` pairs; else str()."""
    if hasattr(value, "describe"):
        return value.describe()
    if isinstance(value, dict):
        return " ".join(str(item) if key == "type" else f"{key}={item}" for key, item in value.items())
    return str(value)


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """``cls(**data)`` for nested dataclasses: fields typed as a dataclass, an enum or a tuple of them are rebuilt;
    derived fields (``init=False``) and keys ``cls`` lacks are skipped."""
    hints = _type_hints(cls)
    return cls(**{f.name: _typed(hints[f.name], data[f.name]) for f in fields(cls) if f.init and f.name in data})


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates the annotation strings: once per class, not once per record


def _typed(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]
        return tuple(_typed(typing.get_args(hint)[0], item) for item in value)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for candidate in typing.get_args(hint) if union else (hint,):
        if dataclasses.is_dataclass(candidate):
            return from_dict(candidate, value)
        if isinstance(candidate, type) and issubclass(candidate, Enum):
            return candidate(value)
    return value
