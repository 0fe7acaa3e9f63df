"""The throughput figures (lerobot_mg.accounting.throughput): the peak table, the arithmetic of samples/s and MFU,
FLOPs counted on the meta device against a hand count, the phase clock, and how lerobot-mg-compare shows them from
ledgers written here (old ledgers' keys included). No assertion depends on how fast this machine is: the times are
written by the test, or bounded below by a deliberate sleep."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lerobot_mg.accounting.compare import compare_runs, run_throughput
from lerobot_mg.accounting.ledger import IntervalRecord, RunLedger, StartRecord, read_ledger
from lerobot_mg.accounting.report import THROUGHPUT_NOTE, format_markdown, format_text
from lerobot_mg.accounting.throughput import (
    PhaseTimes,
    StepClock,
    compute_precision,
    model_flops_utilisation,
    peak_flops,
    peak_flops_of,
    seconds,
    training_flops_per_sample,
)
from lerobot_mg.config.schema import LoggingConfig, WandbConfig
from lerobot_mg.data.hub import resolve_dataset
from lerobot_mg.distributed.metrics import IntervalMetrics
from lerobot_mg.distributed.parallel_dims import BatchArithmetic, ParallelDims, Topology
from lerobot_mg.policies.base import checkpoint_activations
from lerobot_mg.preflight import check_dataset, meta_policy
from lerobot_mg.run_facts import CodeRevision, Progress, RunFacts, from_dict
from lerobot_mg.step import StepLogs
from lerobot_mg.tracking import ProgressDisplay, RunTracker
from tests.unit.test_vla_presets import composed
from tests.vla_preset_aids import PRESET_TEST_OVERRIDES, VLA_PRESETS, shared_vla_dataset

DIMS = (5, 7, 11, 3)  # input, two hidden widths, output
BATCH = 4


@pytest.mark.parametrize(("name", "precision", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),  # the SXM part's name
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "fp16", 835.5e12),
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA H200", "tf32", 494.5e12),
    ("NVIDIA GH200 480GB", "bf16", 989e12),
    ("NVIDIA B200", "bf16", 2250e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    ("NVIDIA A10G", "bf16", 125e12),  # not A100's
    ("NVIDIA A10", "fp32", 31.2e12),
    ("NVIDIA L40S", "bf16", 362e12),  # not L40's nor L4's
    ("NVIDIA L40", "bf16", 181e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bfloat16 tensor cores: no MFU
    ("NVIDIA GeForce GTX 1080", "fp32", None),  # not in the table
])
def test_the_peak_table_is_matched_by_the_device_name_and_the_precision(name: str, precision: str,
                                                                        peak: float | None) -> None:
    assert peak_flops(name, precision) == peak


def test_an_unknown_precision_column_is_a_bug_and_a_cpu_has_no_peak() -> None:
    with pytest.raises(ValueError, match="precision 'fp8'"):
        peak_flops("NVIDIA H100 80GB HBM3", "fp8")
    assert peak_flops_of(torch.device("cpu"), "fp32") == {"name": "cpu", "precision": "fp32", "peak_flops": None}


def test_the_precision_column_is_the_autocast_dtype_else_the_parameters_dtype() -> None:
    model = nn.Linear(4, 4)
    assert compute_precision("bf16", model) == "bf16" and compute_precision("fp16", model) == "fp16"
    assert compute_precision("no", model) == "fp32"
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert compute_precision("no", model) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert compute_precision("no", model.to(torch.bfloat16)) == "bf16"  # a base stored in bfloat16


def test_samples_per_second_are_the_intervals_samples_over_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    now = iter([100.0, 102.5, 103.0])  # the interval's start, its reduce, the next interval's start
    monkeypatch.setattr("lerobot_mg.distributed.metrics.time.perf_counter", lambda: next(now))
    interval = IntervalMetrics(ParallelDims.resolve(1, None, 1), torch.device("cpu"))
    for _ in range(5):
        interval.add({"loss": 1.0}, num_samples=8)
    reduced, _ = interval.reduce()
    assert reduced["samples_per_s"] == 40 / 2.5
    assert "peak_device_memory_gb" not in reduced  # CUDA only


def test_mfu_arithmetic() -> None:
    # 12.6 samples/s per GPU of a 9.84 TFLOP sample on an H100 SXM: 12.6 x 9.84e12 / 989e12.
    assert model_flops_utilisation(9.84e12, 12.6, 989e12) == pytest.approx(0.12536, rel=1e-4)
    assert model_flops_utilisation(1e9, 100.0, 1e12) == pytest.approx(0.1, rel=1e-15)


class LinearStack(nn.Module):
    """A policy-shaped Linear stack: ``example_batch`` and ``forward(batch) -> (loss, logs)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def example_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(batch_size, DIMS[0])}

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        x = batch["x"]
        for index, layer in enumerate(self.layers):
            x = layer(x) if index == len(self.layers) - 1 else torch.relu(layer(x))
        return x.square().mean(), {}


def meta_stack() -> LinearStack:
    with torch.device("meta"):
        return LinearStack()


def hand_count(first_trainable: bool = True) -> int:
    """FLOPs per sample of one training step of the stack: a matmul of (in x out) costs 2 x in x out per sample;
    the forward does one per layer, the backward one for each trainable weight's gradient and one for the gradient
    of each layer's input that has a trainable weight before it (the batch needs none; with the first layer frozen
    neither does its output). Bias additions, activations and the loss are not matmuls and count 0, as in torch's
    FlopCounterMode."""
    pairs = list(zip(DIMS, DIMS[1:]))
    forward = sum(2 * a * b for a, b in pairs)
    weight_grads = sum(2 * a * b for index, (a, b) in enumerate(pairs) if first_trainable or index > 0)
    input_grads = sum(2 * a * b for a, b in pairs[1 if first_trainable else 2:])
    return forward + weight_grads + input_grads


def test_flops_per_sample_on_the_meta_device_equal_the_hand_count() -> None:
    flops, how = training_flops_per_sample(meta_stack(), BATCH)
    # All weights trainable: 6 x (weights) per sample, less the first layer's input gradient (2 x 5 x 7).
    assert flops == hand_count() == 6 * (5 * 7 + 7 * 11 + 11 * 3) - 2 * 5 * 7, how
    assert "meta device" in how and "without activation recomputation" in how


def test_a_frozen_layer_has_no_weight_gradient_to_count() -> None:
    model = meta_stack()
    model.layers[0].requires_grad_(False)
    assert training_flops_per_sample(model, BATCH)[0] == hand_count(first_trainable=False)


def test_activation_checkpointing_does_not_count_the_recomputed_forward() -> None:
    model = meta_stack()
    checkpoint_activations(model.layers[1])
    assert training_flops_per_sample(model, BATCH)[0] == hand_count()


def test_a_step_that_reads_values_on_the_host_is_not_counted_but_a_yes_no_check_is() -> None:
    class ReadsAFloat(LinearStack):
        def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            loss, logs = super().forward(batch)
            return loss * float(batch["x"].sum()), logs

    class ChecksAMask(LinearStack):
        def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            assert bool((batch["x"] == 0).all())  # what transformers' attention asks before skipping a mask
            return super().forward(batch)

    with torch.device("meta"):
        reads, checks = ReadsAFloat(), ChecksAMask()
    flops, how = training_flops_per_sample(reads, BATCH)
    assert flops is None and how.startswith("not counted: ReadsAFloat's training step does not run on the meta")
    assert training_flops_per_sample(checks, BATCH)[0] == hand_count()
    flops, how = training_flops_per_sample(nn.Linear(2, 2, device="meta"), BATCH)
    assert flops is None and how == "not counted: Linear has no example_batch"


@pytest.fixture(scope="module")
def vla_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_vla_dataset(tmp_path_factory)


@pytest.mark.parametrize("preset", ["pusht_debug", "pusht_debug_diffusion", *VLA_PRESETS])
def test_every_policys_training_step_is_counted_on_the_meta_device(preset: str, vla_dataset: Path) -> None:
    """A policy whose step does not run on the meta device (a generator made on the batch's device, a value read
    on the host) gets no FLOPs and no MFU, and the memory plan no activation estimate: every policy must run."""
    cfg = composed([f"experiment={preset}", *([f"dataset.root={vla_dataset}", *PRESET_TEST_OVERRIDES]
                                              if preset in VLA_PRESETS else [])])
    meta, _ = check_dataset(cfg, 1, Path(resolve_dataset(cfg.dataset).root))
    flops, how = training_flops_per_sample(meta_policy(cfg, meta), cfg.batch_size)
    assert flops is not None and flops > 0, how


class FakeEvent:
    """A CUDA event's interface, at a time the test sets (milliseconds, as CUDA reports them)."""

    def __init__(self, ms: float) -> None:
        self.ms, self.synchronized = ms, False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert end.synchronized, "read before the device reached the end mark"
        return end.ms - self.ms


def test_device_marks_are_read_once_the_device_reached_them_in_seconds() -> None:
    phases = PhaseTimes()
    phases.add(0.0, (FakeEvent(0.0), FakeEvent(2.0), FakeEvent(12.0)))
    phases.add(0.0, (FakeEvent(20.0), FakeEvent(24.0), FakeEvent(44.0)))
    assert phases.take(2) == pytest.approx({"dataloading_s": 0.0, "preprocessing_s": 0.003, "update_s": 0.015})
    assert seconds(FakeEvent(1.0), FakeEvent(251.0)) == 0.25


def test_the_phase_clock_means_each_phase_over_the_interval_steps() -> None:
    clock, phases = StepClock(torch.device("cpu")), PhaseTimes()
    for wait in (0.25, 0.75):
        began = clock.mark()
        forward_began = clock.mark()
        time.sleep(0.05)  # the "update"
        phases.add(wait, (began, forward_began, clock.mark()))
    means = phases.take(2)
    assert means["dataloading_s"] == 0.5  # the waits given, over 2 steps
    assert 0 <= means["preprocessing_s"] <= means["update_s"] and means["update_s"] >= 0.05
    assert phases.take(1) == {"dataloading_s": 0.0, "preprocessing_s": 0.0, "update_s": 0.0}  # a new interval


def test_the_progress_line_shows_the_mfu_where_known(capsys: pytest.CaptureFixture[str]) -> None:
    display = ProgressDisplay(10, Progress(), 8, log_every_s=1e9, terminal=False, clock=iter(range(100)).__next__)
    display.step_done(0.0, 0.5, force_line=True, mfu=0.4125)
    display.step_done(0.0, 0.5, force_line=True)
    first, second = capsys.readouterr().out.splitlines()
    assert "| MFU 41.2% |" in first and "MFU" not in second


# --- the ledger and lerobot-mg-compare ---------------------------------------------------------------------------

def facts(world_size: int, flops: int | None, device: dict | None) -> RunFacts:
    return RunFacts(batch=BatchArithmetic(8, world_size, 1), topology=Topology(1, world_size, world_size),
                    precision="bf16", checkpoint_format="safetensors", code_revision=CodeRevision("c" * 40, False),
                    dataset_fingerprint="embedded:abc", lr_schedule={"type": "constant"},
                    model={"total_params": 10, "trainable_params": 10}, rank_bytes=({"parameters": 40},) * world_size,
                    flops_per_sample=flops, device=device)


def write_run(run_dir: Path, run_facts: RunFacts, intervals: list[dict[str, float]]) -> Path:
    ledger = RunLedger(run_dir, True)
    ledger.write(StartRecord(0.0, Progress(), run_facts))
    per_step = run_facts.batch.samples_per_loop_step
    for number, metrics in enumerate(intervals, 1):
        ledger.write(IntervalRecord(float(number), Progress(10 * number, 10 * number * per_step, 10 * number),
                                    float(number), {"loss": 1.0, "lr": 1e-4, **metrics}))
    ledger.close()
    return run_dir


H100 = {"name": "NVIDIA H100 80GB HBM3", "precision": "bf16", "peak_flops": 989e12}


def figures(samples_per_s: float, update_s: float, update_s_rank0: float, peak_gb: float) -> dict[str, float]:
    return {"samples_per_s": samples_per_s, "samples_per_s_per_device": samples_per_s / 2,
            "mfu": model_flops_utilisation(1e12, samples_per_s / 2, 989e12), "dataloading_s": 0.02,
            "dataloading_s_rank0": 0.01, "preprocessing_s": 0.003, "preprocessing_s_rank0": 0.002,
            "update_s": update_s, "update_s_rank0": update_s_rank0, "peak_device_memory_gb": peak_gb}


def test_compare_shows_each_runs_throughput_figures_side_by_side(tmp_path: Path) -> None:
    # The first interval (start-up) is left out of the medians, not out of the peak memory.
    new = write_run(tmp_path / "new", facts(2, 10**12, H100), [
        figures(10.0, 9.0, 8.0, 70.0), figures(200.0, 0.3, 0.25, 40.0), figures(220.0, 0.28, 0.24, 41.0),
        figures(240.0, 0.26, 0.2, 42.0)])
    # A ledger of an older version: "samples/s" and "gpu_peak_memory_gb", no phases, no FLOPs, no device.
    old = write_run(tmp_path / "old", facts(2, None, None), [{"samples/s": 50.0, "gpu_peak_memory_gb": 12.5},
                                                  {"samples/s": 100.0, "gpu_peak_memory_gb": 12.0}])
    throughput = run_throughput(read_ledger(new))
    assert throughput.samples_per_s == 220.0 and throughput.samples_per_s_per_device == 110.0
    assert throughput.update_s == 0.28 and throughput.update_s_rank0 == 0.24
    assert throughput.mfu == model_flops_utilisation(1e12, 110.0, 989e12)
    assert throughput.peak_device_memory_gb == 70.0 and throughput.flops_per_sample == (10**12,)
    assert throughput.devices == ("NVIDIA H100 80GB HBM3, peak 989 TFLOP/s bf16",)
    old_throughput = run_throughput(read_ledger(old))
    assert (old_throughput.samples_per_s, old_throughput.samples_per_s_per_device) == (100.0, 50.0)
    assert old_throughput.peak_device_memory_gb == 12.5 and old_throughput.update_s is None

    comparison = compare_runs([read_ledger(new), read_ledger(old)])
    table = dict(comparison.table)
    assert table["samples/s (cluster)"] == ("220", "100")
    assert table["samples/s per device"] == ("110", "50")
    assert table["MFU"] == (f"{100 * 1e12 * 110 / 989e12:.3g} %", "-")
    assert table["data wait s/step, slowest rank"] == ("0.02 (rank 0 0.01)", "-")
    assert table["preprocessing s/step, slowest rank"] == ("0.003 (rank 0 0.002)", "-")
    assert table["update s/step, slowest rank"] == ("0.28 (rank 0 0.24)", "-")
    assert table["peak device memory (GB)"] == ("70.000", "12.500")
    assert table["model FLOPs per sample"] == ("1 TFLOP", "not counted")
    assert table["device"] == ("NVIDIA H100 80GB HBM3, peak 989 TFLOP/s bf16", "not recorded")
    assert not any("samples/s" in line or "MFU" in line for line in comparison.differences)  # measured, not named
    text, markdown = format_text(comparison, None), format_markdown(comparison, None, None)
    assert "| 0.28 (rank 0 0.24)" in text and THROUGHPUT_NOTE in text
    assert "| update s/step, slowest rank | 0.28 (rank 0 0.24) | - |" in markdown and THROUGHPUT_NOTE in markdown


def test_facts_of_older_starts_read_back_and_flops_are_no_change_at_a_resume() -> None:
    recorded = facts(1, 123, H100)
    old = {key: value for key, value in dataclasses.asdict(recorded).items()
           if key not in ("flops_per_sample", "device")}
    read = from_dict(RunFacts, old)
    assert read.flops_per_sample is None and read.device is None
    assert recorded.changes_since(read) == ()  # a start of an older version recorded neither
    assert dataclasses.replace(recorded, flops_per_sample=456).changes_since(recorded) == ()
    other = dataclasses.replace(recorded, device={**H100, "name": "NVIDIA A100-SXM4-80GB", "peak_flops": 312e12})
    assert [change.name for change in other.changes_since(recorded)] == ["device"]
    assert recorded.describe()[-1] == ("model FLOPs per sample (forward + backward): 123 FLOP  device: NVIDIA H100 "
                                       "80GB HBM3, peak 989 TFLOP/s bf16")


def test_the_tracker_records_mfu_against_the_recorded_peak(tmp_path: Path) -> None:
    """The tracker's arithmetic in one process, with a GPU's peak in the facts (a CPU run records no MFU):
    MFU = FLOPs per sample x samples/s per device / peak, and one process is its own slowest rank."""
    run_facts = facts(1, 10**9, H100)
    logging = LoggingConfig(wandb=WandbConfig(mode="disabled"), progress_bar=False)  # type: ignore[arg-type]
    tracker = RunTracker(logging, 2, 2, run_facts, Progress(), ParallelDims.resolve(1, None, 1), tmp_path,
                         torch.device("cpu"), {"job_name": "throughput"})
    clock = StepClock(torch.device("cpu"))
    for wait in (0.01, 0.03):
        logs = StepLogs()
        began = clock.mark()
        logs.losses, logs.synced, logs.lr = {"loss": torch.tensor(1.0)}, True, 1e-4
        logs.marks = (began, clock.mark(), clock.mark())
        tracker.step_done(logs, torch.arange(8), wait)
    tracker.close()
    metrics = read_ledger(tmp_path).intervals[-1].metrics
    assert metrics["mfu"] == model_flops_utilisation(10**9, metrics["samples_per_s_per_device"], 989e12)
    assert metrics["samples_per_s_per_device"] == metrics["samples_per_s"]
    assert metrics["dataloading_s"] == metrics["dataloading_s_rank0"] == pytest.approx(0.02, rel=1e-12)
    for phase in ("preprocessing_s", "update_s"):
        assert metrics[phase] == metrics[f"{phase}_rank0"] >= 0
