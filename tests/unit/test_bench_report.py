"""scripts/bench_report.py turns the benchmarks' JSON into docs/benchmarks.md: a table per benchmark with each
figure's goal, its measured value and whether it meets the goal, under the machine the figures were measured on; a
benchmark without results says how to get them. The machine comes from scripts/benchmarking.py's machine()."""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.launch_utils import PYTHON, REPO, clean_env

MACHINE = {"cpu": "Example CPU 9000", "logical_cpus": 16, "usable_cpus": 8, "memory_bytes": 64 * 2**30,
           "gpus": ["Example GPU"], "os": "Linux-6.1-x86_64", "python": "3.11.7", "torch": "2.13.0+cpu",
           "accelerate": "1.16.0"}


def test_the_report_has_a_table_per_benchmark_with_goal_and_verdict(tmp_path: Path) -> None:
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "bench_dcp.json").write_text(json.dumps({"machine": MACHINE, "results": [
        {"name": "dcp_load_over_raw_read", "value": 1.25, "goal": 1.5, "unit": "x", "goal_is": "at_most"},
        {"name": "async_save_blocked_over_sync", "value": 0.5, "goal": 0.25, "unit": "x", "goal_is": "at_most"},
        {"name": "sync_save_s", "value": 2.0, "goal": None, "unit": "s", "goal_is": None},
    ]}))
    (bench_dir / "bench_data.json").write_text(json.dumps({"machine": {**MACHINE, "gpus": []}, "results": [
        {"name": "loader_decode_over_raw_decode", "value": 0.9, "goal": 0.8, "unit": "x", "goal_is": "at_least"},
    ]}))
    out = tmp_path / "benchmarks.md"
    subprocess.run([PYTHON, str(REPO / "scripts" / "bench_report.py"), "--bench-dir", str(bench_dir), "--out", str(out)],
                   check=True, env=clean_env(), cwd=REPO, capture_output=True, timeout=120)
    text = out.read_text()
    assert "| `dcp_load_over_raw_read` | <= 1.5 x | 1.25 x | met |" in text
    assert "| `async_save_blocked_over_sync` | <= 0.25 x | 0.5 x | **not met** |" in text
    assert "| `sync_save_s` |  | 2 s |  |" in text
    assert "| `loader_decode_over_raw_decode` | >= 0.8 x | 0.9 x | met |" in text
    # Each measured section names its machine.
    machine = ("Example CPU 9000 (8 of 16 logical CPUs usable), 64 GiB memory, {}; Linux-6.1-x86_64; Python 3.11.7, "
               "torch 2.13.0+cpu, accelerate 1.16.0.")
    dcp, data = text.split("## `bench_dcp.py`")[1], text.split("## `bench_data.py`")[1]
    assert machine.format("Example GPU") in dcp.split("##")[0]
    assert machine.format("no GPU") in data.split("##")[0]
    # Every benchmark script has its section; one without results says which command writes them.
    for script in sorted((REPO / "scripts").glob("bench_*.py")):
        if script.name != "bench_report.py":
            assert f"## `{script.name}`" in text
    assert "Not measured yet: `make bench` (or `python scripts/bench_peft.py`)" in text


def _bench_module(monkeypatch: pytest.MonkeyPatch):
    """scripts/benchmarking.py as the benchmarks import it (scripts/ on the path, which spawned ranks inherit)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    return importlib.import_module("benchmarking")


def test_a_benchmark_writes_the_machine_and_the_report_names_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    benchmarking = _bench_module(monkeypatch)
    # A figure computed from tensors may still be a 0-d tensor: it is written as its number.
    results = [benchmarking.BenchResult("sync_save_s", 2.0, None, "s"),
               benchmarking.BenchResult("loss_difference", torch.tensor(0.25), 1e-4, "ratio")]
    benchmarking.report("bench_dcp", results, tmp_path / "bench")
    document = json.loads((tmp_path / "bench" / "bench_dcp.json").read_text())
    assert [result["value"] for result in document["results"]] == [2.0, 0.25]
    assert document["machine"]["torch"] == torch.__version__ and document["machine"]["usable_cpus"] >= 1
    out = tmp_path / "benchmarks.md"
    subprocess.run([PYTHON, str(REPO / "scripts" / "bench_report.py"), "--bench-dir", str(tmp_path / "bench"),
                    "--out", str(out)], check=True, env=clean_env(), cwd=REPO, capture_output=True, timeout=120)
    section = out.read_text().split("## `bench_dcp.py`")[1].split("##")[0]
    assert f"on: {document['machine']['cpu']} (" in section and f"torch {torch.__version__}" in section


def _tensor_rank(rank: int, world_size: int, port: int) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    value = torch.full((3,), float(rank + 1))
    dist.all_reduce(value)
    return {"rank": rank, "sum": value}


@pytest.mark.dist
def test_run_on_ranks_returns_rank_zeros_value_even_a_tensor_after_the_rank_exited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A tensor sent through a torch multiprocessing queue is a handle to the sender's shared memory: once the rank
    # has exited, reading it failed (FileNotFoundError in rebuild_storage_fd), which stopped `make bench`.
    benchmarking = _bench_module(monkeypatch)
    result = benchmarking.run_on_ranks(_tensor_rank, (), timeout=600)
    assert result["rank"] == 0 and torch.equal(result["sum"], torch.full((3,), 3.0))
