"""Console entry points (pyproject [project.scripts]); scripts/*.py call the same functions."""

from __future__ import annotations

import logging
import os
import sys


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
    def _main(composed: DictConfig) -> None:
        from lerobot_mg.train import train as run_training

        logging.getLogger("lerobot_mg").setLevel(logging.INFO)
        try:
            overrides = list(HydraConfig.get().overrides.task)
            if composed.resume:  # the saved config already holds the base's policy config
                composed = merge_resume_config(composed, overrides)
            elif composed.policy.path is not None:
                composed = apply_policy_path(composed, overrides)
            run_training(to_train_config(composed), composed)
        except ValueError as error:
            # User errors (bad config, unusable checkpoint, refused environment) are found before training
            # starts; their message says what to change, a traceback would only bury it.
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            if os.environ.get("RANK", "0") == "0":
                print(f"lerobot-mg-train: error: {error}", file=sys.stderr, flush=True)
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
