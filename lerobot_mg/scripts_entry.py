"""Console entry points (pyproject [project.scripts]); scripts/*.py call the same functions.

Every command takes Hydra's ``key=value`` and LeRobot's ``--key=value`` alike: training through Hydra, the
others through lerobot_mg/cli.py; ``--help`` lists the keys.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lerobot_mg.cli import lerobot_train_argv
from lerobot_mg.errors import ConfigError, report_user_error

logger = logging.getLogger("lerobot_mg.train")
# How long a rank other than the main one waits before exiting on a user error (see train()).
USER_ERROR_GRACE_S = 5.0


def train() -> None:
    # The imports below (torch and the trainer) create a few hundred thousand objects that live as long as the
    # process. Collected while they load, they are scanned over and over by full collections (about 0.8 s of a
    # start); loaded with the collector off and then frozen, they are never scanned.
    gc.disable()
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from lerobot_mg.config import register_configs
    from lerobot_mg.config.loading import (
        CONF_DIR,
        check_choices,
        check_presets,
        merge_resume_config,
        normalize_argv,
        override_keys,
        run_config,
    )
    from lerobot_mg.distributed.faults import report_failure
    from lerobot_mg.launch.sweep import prepare_sweep_job
    from lerobot_mg.peft.base import apply_policy_path
    from lerobot_mg.train import train as run_training

    gc.freeze()
    gc.enable()
    try:  # before Hydra composes: it would list the presets (or the allowed words) over several lines and exit 1
        # lerobot-train's names of keys named differently here (--eval_freq, --save_checkpoint, ...) as ours.
        sys.argv = [sys.argv[0], *normalize_argv(lerobot_train_argv(sys.argv[1:]))]
        check_presets(sys.argv[1:])
        check_choices(sys.argv[1:])
    except ConfigError as error:
        report_user_error(error)
        raise SystemExit(2) from None
    register_configs()
    # ${lerobot_mg_presets:} in conf/hydra/help/train.yaml: the presets the --help page lists.
    OmegaConf.register_new_resolver("lerobot_mg_presets", lambda: preset_listing(CONF_DIR), replace=True)

    @hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
    def _main(composed: DictConfig) -> dict:
        from hydra.types import RunMode

        logging.getLogger("lerobot_mg").setLevel(logging.INFO)
        hydra_cfg = HydraConfig.get()
        try:
            composed, sweep_job = prepare_sweep_job(composed, hydra_cfg)
            overrides = list(hydra_cfg.overrides.task)
            if composed.resume and sweep_job is None:  # the saved config already holds the base's policy config
                composed = merge_resume_config(composed, overrides)
            elif composed.policy.path is not None:  # a sweep job resuming itself recomposes like its first attempt
                composed = apply_policy_path(composed, overrides)
            return run_training(run_config(composed, frozenset(override_keys(overrides))), composed, sweep_job)
        except Exception as error:
            if hydra_cfg.mode == RunMode.MULTIRUN:
                # Hydra records the failed point and goes on with the next one; the sweep exits non-zero at the end.
                logger.error("sweep job #%s (%s) failed: %s", hydra_cfg.job.num, " ".join(hydra_cfg.overrides.task),
                             error, exc_info=not isinstance(error, ConfigError))
                raise
            # User errors (bad config, unusable checkpoint, refused environment) are found before training
            # starts; their message says what to change, a traceback would only bury it.
            if not isinstance(error, ConfigError) or os.environ.get("HYDRA_FULL_ERROR") == "1":
                # Anything else is a bug or a fault: its traceback, from the rank that raised it, here rather than
                # through Hydra (which would print it without the rank, behind a HYDRA_FULL_ERROR hint). Exiting
                # non-zero makes torchrun / accelerate launch stop the other ranks at once.
                report_failure(error)  # exits 1
            if os.environ.get("RANK", "0") == "0":
                report_user_error(error)
            else:
                # Every rank meets the same user error before any process group exists; the main process prints
                # it. A rank that exited first would make torchrun stop the main process before its line is out.
                time.sleep(USER_ERROR_GRACE_S)
            raise SystemExit(2) from None

    _main()


def preset_listing(conf_dir: Path) -> str:
    """``group: option, ...``, one line per config group: the files in ``conf_dir/<group>/`` a user picks with
    ``group=option`` (Hydra's own list would add the schema entries of the ConfigStore). The folder of the help
    page itself is not a group a user picks."""
    groups = sorted({path.parent for path in conf_dir.rglob("*.yaml")} - {conf_dir, conf_dir / "hydra" / "help"})
    return "\n".join(
        f"{group.relative_to(conf_dir).as_posix()}: {', '.join(sorted(path.stem for path in group.glob('*.yaml')))}"
        for group in groups
    )


def convert_dcp() -> None:
    from lerobot_mg.checkpoint.convert import main

    raise SystemExit(main())


@dataclass(frozen=True)
class CompareArgs:
    """Compare training runs by their ledgers: sample presentations, optimizer updates, effective batch, what was
    held fixed, and the conditions of every resume. Exit status 0; 1 when check_resume finds a resumed stream
    neither sample-exact nor global-batch-exact (or cannot tell); 2 on a user error."""

    run_dirs: list[Path] = field(metadata={"positional": True, "help": "run directories (>= 2), or bare arguments"})
    check_resume: bool = field(default=False, metadata={"help": "with two runs, one resumed: compare the digests of "
                                                                "what the loaders delivered around each resume"})
    window: int | None = field(default=None, metadata={"help": "with check_resume: that many updates either side"})
    out: Path | None = field(default=None, metadata={"help": "for the PNG and report.md (outputs/compare/<runs>)"})
    json: bool = field(default=False, metadata={"help": "print one JSON object instead of the text report"})
    tolerance: float | None = field(default=None, metadata={
        "help": "relative tolerance within which figures measured by the clock (compute budget) count as held "
                "fixed (null: 0.1, 10 %); counts are always compared exactly"})


def compare_runs(argv: list[str] | None = None) -> int:
    """``lerobot-mg-compare``; returns the exit status."""
    from lerobot_mg import cli

    return cli.run(CompareArgs, _compare, "lerobot-mg-compare", argv=argv)


def _compare(args: CompareArgs) -> int:
    from lerobot_mg.accounting import compare, report
    from lerobot_mg.accounting.ledger import read_ledger

    records = [read_ledger(run_dir) for run_dir in args.run_dirs]
    tolerance = compare.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    comparison = compare.compare_runs(records, tolerance)
    if args.window is not None and not args.check_resume:
        raise ConfigError(f"window={args.window!r}: only applies with check_resume=true. Fix: add check_resume=true, or "
                          "drop window")
    check = compare.check_resume(*compare.pick_resumed_run(records), window=args.window) if args.check_resume else None
    default_name = re.sub(r"[^\w.-]+", "_", "__vs__".join(compare.run_labels(records)))[:150]
    out_dir = args.out or Path("outputs/compare") / default_name
    plot = report.plot_learning_curves(records, out_dir / "learning_curves.png")
    markdown = out_dir / "report.md"
    markdown.write_text(report.format_markdown(comparison, check, plot.name), encoding="utf-8")
    if args.json:
        print(report.to_json(comparison, check, plot=plot, report=markdown))
    else:
        print(f"{report.format_text(comparison, check)}\nwrote {plot} and {markdown}")
    return 0 if check is None or check.passed else 1


def make_dataset() -> None:
    from lerobot_mg.sim.cli import make_dataset_main

    raise SystemExit(make_dataset_main())


def eval_policy() -> None:
    from lerobot_mg.sim.cli import eval_main

    raise SystemExit(eval_main())
