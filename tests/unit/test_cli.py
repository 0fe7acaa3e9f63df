"""One argument style for every console command: key=value and --key=value, read into the command's dataclass."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lerobot_mg.checkpoint import convert
from lerobot_mg.checkpoint.convert import ConvertArgs
from lerobot_mg.cli import LEROBOT_TRAIN_KEYS, help_text, lerobot_train_argv, parse, plain_text, run
from lerobot_mg.config import register_configs
from lerobot_mg.config.loading import CONF_DIR, normalize_argv, to_train_config
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.errors import ConfigError
from lerobot_mg.scripts_entry import CompareArgs, compare_runs
from lerobot_mg.sim.cli import EvalArgs, MakeDatasetArgs, eval_main, make_dataset_main
from tests.launch_utils import PYTHON, REPO, TRAIN_SCRIPT, clean_env


@dataclass(frozen=True)
class Args:
    """A toy command."""

    root: Path = field(metadata={"help": "where"})
    count: int = 2
    size: list[int] | None = None
    flag: bool = False
    codec: str = field(default="h264", metadata={"choices": ("h264", "av1")})


@pytest.mark.parametrize(
    "argv",
    [
        ["root=/r", "count=3", "size=[240,320]", "flag=true", "codec=av1"],  # Hydra
        ["--root=/r", "--count=3", "--size=[240,320]", "--flag=true", "--codec=av1"],  # LeRobot
        ["--root", "/r", "--count", "3", "--size", "240", "320", "--flag", "--codec", "av1"],  # argparse days
        ["root=/r", "--count=3", "size=240,320", "--flag", "codec=av1"],  # mixed
    ],
)
def test_every_spelling_gives_the_same_arguments(argv: list[str]) -> None:
    assert parse(Args, argv) == Args(Path("/r"), 3, [240, 320], True, "av1")


def test_defaults_and_null() -> None:
    assert parse(Args, ["root=x"]) == Args(Path("x"))
    assert parse(Args, ["root=x", "size=[1,2]", "size=null"]).size is None  # the last spelling of a key wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["root=x", "count=many"], "count='many': expected int. Fix: count=<int>"),
        (["root=x", "codec=vp9"], "codec='vp9': expected one of h264, av1. Fix: codec=h264"),
        (["count=1"], "root=None: is required. Fix: root=<path>"),
        (["root=x", "--colour=red"],
         "--colour=red: unknown argument. Fix: one of root, count, size, flag, codec (key=value)"),
        (["root=x", "stray"], "stray: is not key=value. Fix: root=<value>"),
    ],
)
def test_errors_name_the_key_the_value_and_the_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse(Args, argv)
    assert str(error.value) == message


def test_help_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(Args, lambda args: 0, "toy", argv=["--help"]) == 0
    assert capsys.readouterr().out == help_text(Args, "toy", None) + "\n"
    assert help_text(Args, "toy", None).splitlines()[-5:] == [
        "  root=<path>  (required) where",
        "  count=<int>  (default: 2)",
        "  size=<[int,...]>  (default: null)",
        "  flag=<true|false>  (default: false)",
        "  codec=<h264|av1>  (default: h264)",
    ]


@pytest.mark.parametrize(
    ("args_type", "argv", "expected"),
    [
        (ConvertArgs, ["checkpoint_dir=ck", "delete_dcp=true"], ConvertArgs(Path("ck"), True)),
        (MakeDatasetArgs, ["root=d", "num_episodes=3", "image_size=[48,64]"],
         MakeDatasetArgs(Path("d"), 3, 0, [48, 64])),
        (EvalArgs, ["policy_path=p", "n_episodes=5"], EvalArgs(Path("p"), n_episodes=5)),
        (CompareArgs, ["run_dirs=[a,b]", "check_resume=true", "window=2"],
         CompareArgs([Path("a"), Path("b")], True, 2)),
    ],
)
def test_every_console_command_takes_both_spellings(args_type: type, argv: list[str], expected: object) -> None:
    assert parse(args_type, argv) == parse(args_type, [f"--{arg}" for arg in argv]) == expected


def test_command_checks_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"give exactly one of policy_path=<pretrained_model directory> and expert"):
        parse(EvalArgs, ["n_episodes=5"])
    assert parse(EvalArgs, ["--expert"]).expert
    assert parse(CompareArgs, ["a", "b", "--check-resume", "--out", "o"]) == CompareArgs(
        [Path("a"), Path("b")], True, None, Path("o"))


def test_docstrings_print_as_plain_text() -> None:
    doc = """Merge ``a`` into `b` (see :mod:`lerobot_mg.cli`).

        ```bash
        tool key=value
        ```

        ``key`` is a path.
        """
    assert plain_text(doc) == "Merge a into b (see lerobot_mg.cli).\n\n  tool key=value\n\nkey is a path."


@pytest.mark.parametrize(
    ("main", "prog"),
    [(convert.main, "lerobot-mg-convert-dcp"), (compare_runs, "lerobot-mg-compare"),
     (make_dataset_main, "lerobot-mg-make-dataset"), (eval_main, "lerobot-mg-eval")],
)
def test_every_other_command_prints_its_help_as_plain_text(
    main: Callable[[list[str]], int], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} key=value ... (or --key=value)\n\n")
    assert "`" not in out  # no ``literal``, `code` or ``` fence: a terminal shows them as they are
    assert not [line for line in out.splitlines() if line.startswith("    ")]  # docstring indentation removed
    assert "\nkeys:\n" in out


def test_convert_help_indents_its_example_commands(capsys: pytest.CaptureFixture[str]) -> None:
    convert.main(["--help"])
    assert "\n  lerobot-mg-convert-dcp checkpoint_dir=outputs/train/run/checkpoints/005000\n" in capsys.readouterr().out


def test_train_help_names_the_command_its_quick_start_and_only_the_real_presets() -> None:
    proc = subprocess.run([PYTHON, str(TRAIN_SCRIPT), "--help"], env=clean_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("lerobot-mg-train: train a policy"), out[:200]
    assert "powered by Hydra" not in out and "scripts_entry" not in out
    quick_start = out.split("== Quick start ==\n", 1)[1].split("\n\n", 1)[0]
    for command in ("lerobot-mg-train experiment=pusht_debug\n",
                    "torchrun --nproc-per-node=2 --no-python lerobot-mg-train experiment=pusht_debug "
                    "parallelism.dp_shard=2",
                    "lerobot-mg-train resume=true config_path=", "lerobot-mg-train -m optimizer.lr=",
                    "lerobot-mg-train -m hydra/launcher=slurm"):
        assert command in quick_start, quick_start
    presets = out.split("== Presets (group=option) ==\n", 1)[1].split("\n\n", 1)[0].splitlines()
    conf = REPO / "conf"
    groups = sorted(["hydra/launcher", *(path.name for path in conf.iterdir() if path.is_dir() and path.name != "hydra")])
    assert presets == [f"{group}: {', '.join(sorted(path.stem for path in (conf / group).glob('*.yaml')))}"
                       for group in groups]
    assert "policy: act, diffusion, pi0, pi05, smolvla" in presets  # not the ConfigStore's act_schema and diffusion_schema
    assert "\n== Config (key=value; the values this command line composes) ==\nparallelism:\n" in out


# --- lerobot-train's names of keys named differently here ------------------------------------------------------


def test_lerobot_train_names_are_read_as_ours_in_both_spellings() -> None:
    argv = ["--eval_freq=500", "save_checkpoint=false", "--save_freq=250", "--wandb.mode=disabled",
            "--wandb.project=p", "wandb.entity=team", "--steps=10", "experiment=pusht_debug", "-m"]
    assert lerobot_train_argv(argv) == [
        "eval.freq=500", "checkpoint.save_checkpoint=false", "checkpoint.save_freq=250", "logging.wandb.mode=disabled",
        "logging.wandb.project=p", "logging.wandb.entity=team", "--steps=10", "experiment=pusht_debug", "-m"]


def test_lerobot_train_names_compose_into_the_run_config() -> None:
    argv = ["experiment=pusht_debug", "--eval_freq=4", "--save_checkpoint=false", "--save_freq=2",
            "--wandb.mode=disabled", "--steps=8"]
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_train_config(compose(config_name="train", overrides=normalize_argv(lerobot_train_argv(argv))))
    assert (cfg.eval.freq, cfg.checkpoint.save_checkpoint, cfg.checkpoint.save_freq, cfg.steps) == (4, False, 2, 8)
    assert cfg.logging.wandb.mode.value == "disabled"


def test_every_lerobot_train_name_reads_as_a_key_of_the_schema() -> None:
    schema = OmegaConf.structured(TrainConfig)
    for lerobot_key, ours in LEROBOT_TRAIN_KEYS.items():
        assert OmegaConf.select(schema, ours, default=KeyError) is not KeyError, (lerobot_key, ours)
        assert OmegaConf.select(schema, lerobot_key, default=KeyError) is KeyError, lerobot_key  # not ours too


@pytest.mark.parametrize(
    ("arg", "mode"),
    [("--wandb.enable=true", "online"), ("--wandb.enable", "online"), ("wandb.enable=True", "online"),
     ("--wandb.enable=false", "disabled")],
)
def test_lerobot_wandb_enable_is_refused_naming_the_mode_that_does_what_it_did(arg: str, mode: str) -> None:
    with pytest.raises(ConfigError) as error:
        lerobot_train_argv(["experiment=pusht_debug", arg])
    message = str(error.value)
    assert message.startswith("wandb.enable=") and f". Fix: logging.wandb.mode={mode} (" in message
    assert "\n" not in message


def test_the_training_command_refuses_lerobots_wandb_enable_in_one_line() -> None:
    """Through the real entry point: exit 2 and our one line, not Hydra's struct error over several lines."""
    proc = subprocess.run([PYTHON, str(TRAIN_SCRIPT), "experiment=pusht_debug", "--wandb.enable=false"], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "lerobot-mg-train: error: wandb.enable='false': is LeRobot's switch: here wandb always runs as "
        "logging.wandb.mode says (offline by default: written on this machine, uploaded by nobody). Fix: "
        "logging.wandb.mode=disabled (what LeRobot's wandb.enable=false does)"]
