"""scripts/bench_report.py turns the benchmarks' JSON into docs/benchmarks.md: a table per benchmark with each
figure's goal, its measured value and whether it meets the goal; a benchmark without results says how to get them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.launch_utils import PYTHON, REPO, clean_env


def test_the_report_has_a_table_per_benchmark_with_goal_and_verdict(tmp_path: Path) -> None:
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "bench_dcp.json").write_text(json.dumps([
        {"name": "dcp_load_over_raw_read", "value": 1.25, "goal": 1.5, "unit": "x", "goal_is": "at_most"},
        {"name": "async_save_blocked_over_sync", "value": 0.5, "goal": 0.25, "unit": "x", "goal_is": "at_most"},
        {"name": "sync_save_s", "value": 2.0, "goal": None, "unit": "s", "goal_is": None},
    ]))
    (bench_dir / "bench_data.json").write_text(json.dumps([
        {"name": "loader_decode_over_raw_decode", "value": 0.9, "goal": 0.8, "unit": "x", "goal_is": "at_least"},
    ]))
    out = tmp_path / "benchmarks.md"
    subprocess.run([PYTHON, str(REPO / "scripts" / "bench_report.py"), "--bench-dir", str(bench_dir), "--out", str(out)],
                   check=True, env=clean_env(), cwd=REPO, capture_output=True, timeout=120)
    text = out.read_text()
    assert "| `dcp_load_over_raw_read` | <= 1.5 x | 1.25 x | met |" in text
    assert "| `async_save_blocked_over_sync` | <= 0.25 x | 0.5 x | **not met** |" in text
    assert "| `sync_save_s` |  | 2 s |  |" in text
    assert "| `loader_decode_over_raw_decode` | >= 0.8 x | 0.9 x | met |" in text
    # Every benchmark script has its section; one without results says which command writes them.
    for script in sorted((REPO / "scripts").glob("bench_*.py")):
        if script.name != "bench_report.py":
            assert f"## `{script.name}`" in text
    assert "Not measured yet: `make bench` (or `python scripts/bench_peft.py`)" in text
