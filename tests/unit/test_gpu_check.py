"""scripts/gpu_check.py, the GPU check's driver, without a GPU: a part that needs CUDA reports "skipped: no GPU", a
part that would not end inside the budget is skipped, a failing part is recorded and the next one still runs, the
JSON is rewritten after every part; the figures are read from a ledger (absent keys as null, samples/s from the
counters where the ledger states none) and from a plan=true printout. The whole check runs on the lent GPU machine
(docs/gpu.md), never here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.launch_utils import REPO


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parts_report_skips_failures_and_figures_into_the_json(gpu_check, tmp_path: Path) -> None:
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", budget_s=100, only=None)
    (tmp_path / "out").mkdir()
    check.cuda = False
    check.part("needs_gpu", True, 1, lambda: {"never": "run"})
    check.part("too_long", False, 1000, lambda: {"never": "run"})
    check.part("broken", False, 1, lambda: 1 / 0)
    check.part("fine", False, 1, lambda: {"figure": 3})
    parts = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["parts"]
    assert parts["needs_gpu"]["status"] == "skipped: no GPU"
    assert parts["too_long"]["status"].startswith("skipped: time budget")
    assert parts["broken"]["status"] == "failed: ZeroDivisionError: division by zero"
    assert parts["fine"]["status"] == "ok" and parts["fine"]["figure"] == 3


def test_ledger_figures_take_the_last_interval_and_leave_absent_keys_null(gpu_check, tmp_path: Path) -> None:
    facts = {"topology": {"world_size": 1}, "model": {"total_params": 10, "trainable_params": 8},
             "flops_per_sample": 2_000_000, "device": {"name": "NVIDIA H200", "peak_flops": 989e12}}
    records = [{"kind": "start", "facts": facts},
               {"kind": "interval", "progress": {"step": 10, "samples_seen": 320}, "wall_time_s": 5.0,
                "metrics": {"loss": 2.0}},
               "{torn",
               {"kind": "interval", "progress": {"step": 20, "samples_seen": 640}, "wall_time_s": 7.0,
                "metrics": {"loss": 1.0, "update_s": 0.2}}]
    (tmp_path / "ledger.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records))
    figures = gpu_check.ledger_figures(tmp_path)
    assert (figures["loss_first"], figures["loss_last"], figures["update_s"]) == (2.0, 1.0, 0.2)
    assert figures["mfu"] is None and figures["samples_per_s"] is None
    assert figures["counters_samples_per_s"] == 160.0  # 320 samples in 2 s
    assert figures["counters_s_per_step"] == 0.2
    gpu_check.fill_derived(figures, "NVIDIA H200")
    assert figures["samples_per_s_per_device"] == 160.0
    assert figures["mfu"] == round(2_000_000 * 160.0 / 989e12, 4)


def test_plan_printout_is_read_into_numbers(gpu_check) -> None:
    output = """memory plan: FSDP2: 1 shard (a 1-rank mesh); batch_size 32 x dp_world_size 1 x grad_accum 1
  parameters: 4,028,019,472
  rank 0 (device): parameters 100.000 MiB (trainable 90.000) + gradients 90.000 + optimizer state 180.000 = 370.000 MiB
  gathered at the peak: 30.000 MiB (root unit)
  activations (estimate): 624.000 MiB (tensors saved for backward)
  evaluation copy: 0.000 MiB (no evaluation configured)
  fit: each rank holds 0.36 GiB of training state <= free memory of cuda:0 130.00 GiB
"""
    plan = gpu_check.parse_plan(output)
    assert plan["parameters"] == 4_028_019_472
    assert (plan["state_per_rank_mib"], plan["gathered_mib"], plan["activations_mib"]) == (370.0, 30.0, 624.0)
    assert plan["planned_peak_gib"] == 1.0  # 1024 MiB
    assert plan["fit"].startswith("fit: each rank holds")
