"""Ctrl-C and SIGTERM lose no work: real runs stopped by a signal save at the step the ranks agreed on, say how to
resume, exit 128 + the signal's number, and a resume from that checkpoint ends bit-identical to an uninterrupted
run (the reference runs of tests/dist/test_checkpoints.py).

The signal comes from the run itself at a fixed loop step (``LEROBOT_MG_FAULT``, lerobot_mg/drills.py): one
process sends SIGINT or SIGTERM to itself; under torchrun, rank 1 sends SIGTERM to the launcher, which forwards it
to every rank (what ``scancel`` or a time limit does), and waits until it is back. So no test races a timer.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from lerobot_mg.accounting.ledger import read_ledger
from lerobot_mg.checkpoint import layout as L
from lerobot_mg.drills import FAULT_ENV
from tests.dist.test_checkpoints import REFERENCE_RUNS, SAVE_FREQ, reference_run
from tests.dist.test_resume import assert_same_checkpoint, update_digests
from tests.launch_utils import TINY_RUN, run_train

pytestmark = pytest.mark.dist

_STOPPED = re.compile(r"^stopped at loop step (\d+) on (SIG\w+): checkpoint (\S+); resume with: (.+)$", re.MULTILINE)


def _stop_and_resume(tmp_path: Path, reference: Path, name: str, fault: str, signum: signal.Signals) -> int:
    """Run ``REFERENCE_RUNS[name]`` with the drill ``fault``; check the stop; resume with the printed command's
    arguments; check the resumed run against the reference. Returns the step it stopped at."""
    spec = REFERENCE_RUNS[name]
    run_dir = tmp_path / "stopped"
    overrides = [*TINY_RUN, f"steps={spec.steps}", f"checkpoint.save_freq={SAVE_FREQ}", "log_freq=2",
                 f"output_dir={run_dir}", *spec.overrides]
    proc = run_train(overrides, nproc=spec.nproc, launcher="torchrun" if spec.nproc > 1 else None, timeout=240,
                     env={FAULT_ENV: fault}, check=False)
    out = proc.stdout
    match = _STOPPED.search(out)
    assert match, out[-6000:]
    step, name_seen, checkpoint, command = int(match[1]), match[2], Path(match[3]), match[4].split()
    assert name_seen == signum.name
    assert 0 < step < spec.steps
    assert "Traceback" not in out.split("stopped at loop step")[0]  # no KeyboardInterrupt from the middle of a step
    if spec.nproc == 1:
        assert proc.returncode == 128 + signum, out[-4000:]
    else:  # torchrun reports the signal it got itself (exit 1 and its SignalException) once the ranks left
        assert proc.returncode != 0, out[-4000:]

    # The checkpoint of the agreed step, complete and `last`; the ledger says why the run stopped, and where.
    assert checkpoint == L.checkpoints_root(run_dir) / L.step_dir_name(step)
    assert (checkpoint / L.TRAINING_STATE_DIR / L.TRAINING_STEP).is_file()
    assert (L.checkpoints_root(run_dir) / L.LAST_LINK).resolve() == checkpoint.resolve()
    stop = read_ledger(run_dir).segments[-1].stop
    assert stop is not None and (stop.signal, stop.progress.step, stop.checkpoint) == (signum.name, step, str(checkpoint))

    # The printed command resumes: its arguments after the script are the resume itself.
    assert command[-2:] == ["resume=true", f"config_path={checkpoint / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON}"]
    run_train(command[-2:], nproc=spec.nproc, timeout=240)
    for later in [*range(SAVE_FREQ * (step // SAVE_FREQ + 1), spec.steps, SAVE_FREQ), spec.steps]:
        assert_same_checkpoint(L.checkpoints_root(run_dir) / L.step_dir_name(later),
                               L.checkpoints_root(reference) / L.step_dir_name(later))
    assert update_digests(run_dir, 0) == update_digests(reference, 0)
    assert read_ledger(run_dir).segments[-1].start.progress.step == step
    return step


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_one_process_stops_on_a_signal_with_a_checkpoint_and_resumes_bit_exact(
        signum: signal.Signals, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One process, SIGINT (Ctrl-C) or SIGTERM during loop step 3: its flag is read at once, so it saves at step 3
    (between the periodic checkpoints of steps 0 and 4) and exits 130 / 143."""
    reference = reference_run(tmp_path_factory, "single")
    step = _stop_and_resume(tmp_path, reference, "single", f"{signum.name.lower()}@rank0:step3", signum)
    assert step == 3


def test_torchrun_fsdp2_stops_on_sigterm_to_the_launcher_and_resumes_bit_exact(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """torchrun, FSDP-2: rank 1 sends SIGTERM to torchrun during loop step 2 and waits for torchrun's SIGTERM.
    The flags are reduced at step 2's boundary and read at the next: every rank saves at step 3."""
    reference = reference_run(tmp_path_factory, "fsdp2")
    step = _stop_and_resume(tmp_path, reference, "fsdp2", "sigterm_launcher@rank1:step2", signal.SIGTERM)
    assert step == 3


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    """The second Ctrl-C does not wait for the checkpoint: the first put back the default action, so the kernel ends
    the process on the second (killed by SIGINT), and no checkpoint of the stop is written (the drill's two signals
    arrive within one loop step). tests/dist/test_stop_signals.py does the same to a rank blocked in a collective."""
    proc = run_train([*TINY_RUN, "steps=20", "checkpoint.save_freq=100", f"output_dir={tmp_path / 'run'}"],
                     timeout=240, env={FAULT_ENV: "sigint_twice@rank0:step3"}, check=False)
    assert proc.returncode == -signal.SIGINT, proc.stdout[-4000:]
    assert "SIGINT received: saving a checkpoint at the next optimizer update" in proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())
