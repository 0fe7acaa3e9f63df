"""Progress that a log file can hold: a SLURM job's .out file (stdout not a terminal) gets plain lines, one every
``logging.log_every_s`` seconds and at every log step, never a carriage-return bar; the evaluation follows the same
rule. No assertion depends on the machine's speed: the clock is injected, or ``log_every_s`` is so long that only
the log steps print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lerobot_mg.run_facts import Progress
from lerobot_mg.tracking import ProgressDisplay
from tests.launch_utils import TINY_RUN, run_train

LINE = re.compile(
    r"^train step (\d+)/(\d+) \(\d+%\) \| samples (\d+) \| updates (\d+) \| loss (-|\d+\.\d{4}) \| "
    r"\d+\.\d samples/s \| data wait \d+% \| ETA (\S+)$"
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _advance(progress: Progress, display: ProgressDisplay, clock: FakeClock, seconds: float, loss: float,
             log_step: bool) -> None:
    clock.now += seconds
    progress.step += 1
    progress.samples_seen += 8
    progress.optimizer_updates += 1
    display.step_done(data_wait_s=seconds / 4, loss=loss, force_line=log_step)


def test_a_file_gets_a_line_every_log_every_s_and_at_every_log_step(capsys: pytest.CaptureFixture[str]) -> None:
    clock, progress = FakeClock(), Progress()
    display = ProgressDisplay(100, progress, samples_per_step=8, log_every_s=30, terminal=False, clock=clock)
    for step in range(1, 11):  # 10 s a step, a log step every 5: lines at 3 (30 s), 5 (log), 8 (30 s), 10 (log)
        _advance(progress, display, clock, 10.0, loss=float("nan") if step < 5 else 0.5, log_step=step % 5 == 0)
    display.close()
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.splitlines()
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [int(m[1]) for m in parsed] == [3, 5, 8, 10]
    assert [(int(m[3]), int(m[4])) for m in parsed] == [(24, 3), (40, 5), (64, 8), (80, 10)]
    assert [m[5] for m in parsed] == ["-", "0.5000", "0.5000", "0.5000"]  # no loss before the first log step
    # 3 steps of 8 samples in 30 s, a quarter of it waiting for data; 97 steps left at 10 s each.
    assert lines[0].endswith("| 0.8 samples/s | data wait 25% | ETA 0:16:10")
    assert lines[-1].endswith("| 0.8 samples/s | data wait 25% | ETA 0:15:00")  # 2 steps in 20 s; 90 left

def test_a_resumed_display_counts_from_the_resumed_step(capsys: pytest.CaptureFixture[str]) -> None:
    clock, progress = FakeClock(), Progress(step=50, samples_seen=400, optimizer_updates=50)
    display = ProgressDisplay(60, progress, samples_per_step=8, log_every_s=1e9, terminal=False, clock=clock)
    for step in range(51, 61):
        _advance(progress, display, clock, 2.0, loss=0.25, log_step=step == 60)
    (line,) = capsys.readouterr().out.splitlines()
    assert LINE.match(line) and line.startswith("train step 60/60 (100%) | samples 480 | updates 60 | loss 0.2500")
    assert line.endswith("| 4.0 samples/s | data wait 25% | ETA 0:00:00")


def test_a_run_into_a_file_prints_one_plain_line_per_log_step(tmp_path: Path) -> None:
    """The real trainer, stdout a pipe: a progress bar on (the default), ``log_every_s`` longer than any run."""
    overrides = [o for o in TINY_RUN if o != "logging.progress_bar=false"]
    proc = run_train([*overrides, "steps=6", "log_freq=2", "logging.log_every_s=1e9", f"output_dir={tmp_path / 'run'}",
                      "checkpoint.save_checkpoint=false"])
    assert "\r" not in proc.stdout  # stdout and stderr together
    lines = [line for line in proc.stdout.splitlines() if line.startswith("train step")]
    assert [int(LINE.match(line)[1]) for line in lines] == [2, 4, 6], proc.stdout[-3000:]
    assert all(LINE.match(line)[5] != "-" for line in lines)


def test_the_evaluation_into_a_file_prints_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    evaluate = pytest.importorskip("lerobot_mg.sim.evaluate")
    clock = FakeClock()
    progress = evaluate.EpisodeProgress(5, log_every_s=30, clock=clock, terminal=False)
    assert list(progress.episodes()) == list(range(5))
    for index in range(5):  # 20 s an episode: lines after 40 s, 80 s and the last one
        clock.now += 20.0
        progress.episode_done(success=index % 2 == 0)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "evaluation episode 2/5 | successes 1 | 20.0 s/episode | ETA 0:01:00",
        "evaluation episode 4/5 | successes 2 | 20.0 s/episode | ETA 0:00:20",
        "evaluation episode 5/5 | successes 3 | 20.0 s/episode | ETA 0:00:00",
    ]


@pytest.mark.sim
def test_the_rollout_loop_into_a_file_prints_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """The real rollout loop, into a capture (not a terminal): the last episode's line only, no bar."""
    evaluate = pytest.importorskip("lerobot_mg.sim.evaluate")
    evaluate.run_evaluation(evaluate.ExpertController(), n_episodes=2, seed_start=100_000, max_steps=2,
                            log_every_s=1e9)
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    assert [line.split(" | ")[0] for line in out.out.splitlines() if line.startswith("evaluation")] == [
        "evaluation episode 2/2"]


def test_a_terminal_keeps_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    clock, progress = FakeClock(), Progress()
    display = ProgressDisplay(10, progress, samples_per_step=8, log_every_s=0, terminal=True, clock=clock)
    for step in range(1, 11):
        _advance(progress, display, clock, 10.0, loss=0.5, log_step=step % 5 == 0)
    display.close()
    out = capsys.readouterr().out
    assert "10/10" in out and "loss=0.5000" in out and "\r" in out  # the bar redraws itself
    assert "train step" not in out
