"""The main process's experiment trackers, wandb and trackio, and the one tracker run a run directory keeps.

A run is one tracker run however often it starts: the first start of a run directory creates its tracker identity
(an id and a name) and stores it in ``<run dir>/tracker_run.json``; every later start of that directory (a resume,
a SLURM requeue after a preemption, a relaunch with ``resume=true``) reads it back and passes it on, so wandb and
trackio continue the same run and its steps go on from the checkpoint's instead of starting a new curve at 0.
Both trackers get the same metrics at the same loop steps (the ledger's interval records), the run config with its
run facts, and the group (a sweep's name). Each is a no-op when disabled and on every rank but the main process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lerobot_mg.config.schema import TrackioConfig, WandbConfig
from lerobot_mg.errors import config_error

TRACKER_RUN_FILENAME = "tracker_run.json"


@dataclass(frozen=True)
class TrackerRun:
    """The identity of a run directory's tracker run: wandb's run id, and the name both trackers show."""

    id: str
    name: str

    @property
    def trackio_name(self) -> str:
        # trackio knows a run by its name alone: the id keeps two runs that share a job and directory name apart.
        return f"{self.name}-{self.id}"


def tracker_run(output_dir: Path, name: str) -> TrackerRun:
    """The tracker run of ``output_dir``: the stored one, or a new one (stored, atomically) on its first start.
    Main process only."""
    path = Path(output_dir) / TRACKER_RUN_FILENAME
    if path.is_file():
        return TrackerRun(**json.loads(path.read_text()))
    run = TrackerRun(secrets.token_hex(4), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(run)) + "\n")
    os.replace(temporary, path)
    return run


def check_trackers(trackio: TrackioConfig) -> None:
    """At start-up: an enabled tracker's package is installed."""
    if trackio.enable and importlib.util.find_spec("trackio") is None:
        raise config_error("trackio.enable", True, "the trackio package is not installed",
                           "pip install -e '.[trackio]' (make setup installs it), or trackio.enable=false")


class WandbLogger:
    """wandb on the main process, continuing the run directory's wandb run; a no-op when disabled."""

    def __init__(self, cfg: WandbConfig, run: TrackerRun | None, output_dir: Path, config: dict[str, Any]):
        self._run = None
        if run is not None and cfg.mode != "disabled":
            import wandb  # a dependency, imported only by the main process of a run that logs to it

            self._run = wandb.init(mode=cfg.mode, project=cfg.project, entity=cfg.entity, group=cfg.group,
                                   id=run.id, name=run.name, dir=str(output_dir), config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class TrackioLogger:
    """trackio on the main process (local-first: a SQLite store under ``$TRACKIO_DIR``, default
    ``~/.cache/huggingface/trackio``; ``trackio show`` opens its dashboard), continuing the run directory's trackio
    run; a no-op when disabled."""

    def __init__(self, cfg: TrackioConfig, run: TrackerRun | None, config: dict[str, Any]):
        self._run = None
        if run is not None and cfg.enable:
            import trackio  # the `trackio` extra, imported only by runs that enable it

            with contextlib.redirect_stdout(io.StringIO()) as said:  # its seven lines become one
                self._run = trackio.init(project=cfg.project, name=run.trackio_name, group=cfg.group, config=config,
                                         resume="allow", embed=False)
            how = "resumed" if "Resumed existing run" in said.getvalue() else "created"
            print(f"trackio: {how} run {run.trackio_name} of project {cfg.project} in {trackio.TRACKIO_DIR}; "
                  f"view it with: trackio show --project {cfg.project}", flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

    def close(self) -> None:
        if self._run is not None:
            import trackio  # the `trackio` extra (already imported by __init__)

            with contextlib.redirect_stdout(io.StringIO()):
                trackio.finish()  # the run's own finish would leave it trackio's current run
            self._run = None


class Trackers:
    """Every enabled tracker of the main process, behind one ``log`` / ``close``."""

    def __init__(self, wandb: WandbConfig, trackio: TrackioConfig, output_dir: Path, is_main: bool,
                 name: str, config: dict[str, Any]):
        enabled = is_main and (wandb.mode != "disabled" or trackio.enable)
        run = tracker_run(output_dir, name) if enabled else None
        self.run = run
        self._sinks = (WandbLogger(wandb, run, output_dir, config), TrackioLogger(trackio, run, config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self._sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
