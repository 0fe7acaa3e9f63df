"""Console entry points (pyproject [project.scripts]); scripts/*.py call the same functions."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("lerobot_mg.train")


def train() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from lerobot_mg.config import register_configs
    from lerobot_mg.config.loading import (
        CONF_DIR,
        apply_policy_path,
        merge_resume_config,
        normalize_argv,
        to_train_config,
    )

    sys.argv = [sys.argv[0], *normalize_argv(sys.argv[1:])]
    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
    def _main(composed: DictConfig) -> dict:
        from hydra.types import RunMode

        from lerobot_mg.config.validate import report_user_error
        from lerobot_mg.launch.sweep import prepare_sweep_job
        from lerobot_mg.train import train as run_training

        logging.getLogger("lerobot_mg").setLevel(logging.INFO)
        hydra_cfg = HydraConfig.get()
        try:
            composed, sweep_job = prepare_sweep_job(composed, hydra_cfg)
            overrides = list(hydra_cfg.overrides.task)
            if composed.resume and sweep_job is None:  # the saved config already holds the base's policy config
                composed = merge_resume_config(composed, overrides)
            elif composed.policy.path is not None:  # a sweep job resuming itself recomposes like its first attempt
                composed = apply_policy_path(composed, overrides)
            return run_training(to_train_config(composed), composed, sweep_job)
        except Exception as error:
            if hydra_cfg.mode == RunMode.MULTIRUN:
                # Hydra records the failed point and goes on with the next one; the sweep exits non-zero at the end.
                logger.error("sweep job #%s (%s) failed: %s", hydra_cfg.job.num, " ".join(hydra_cfg.overrides.task),
                             error, exc_info=not isinstance(error, ValueError))
                raise
            # User errors (bad config, unusable checkpoint, refused environment) are found before training
            # starts; their message says what to change, a traceback would only bury it.
            if not isinstance(error, ValueError) or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            if os.environ.get("RANK", "0") == "0":
                report_user_error(error)
            raise SystemExit(2) from None

    _main()


def convert_dcp() -> None:
    from lerobot_mg.checkpoint.convert import main

    main()


def compare_runs() -> None:
    from lerobot_mg.accounting.report import main

    raise SystemExit(main())


def make_dataset() -> None:
    from lerobot_mg.sim.cli import make_dataset_main

    raise SystemExit(make_dataset_main())


def eval_policy() -> None:
    from lerobot_mg.sim.cli import eval_main

    raise SystemExit(eval_main())
