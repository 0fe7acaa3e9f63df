"""One argument style for every console command: key=value and --key=value, read into the command's dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lerobot_mg.checkpoint.convert import ConvertArgs
from lerobot_mg.cli import help_text, parse, run
from lerobot_mg.errors import ConfigError
from lerobot_mg.scripts_entry import CompareArgs
from lerobot_mg.sim.cli import EvalArgs, MakeDatasetArgs


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
        (["root=x", "count=many"], "count=many: expected int. Fix: count=<int>"),
        (["root=x", "codec=vp9"], "codec=vp9: expected one of h264, av1. Fix: codec=h264"),
        (["count=1"], "root is required. Fix: root=<path>"),
        (["root=x", "--colour=red"],
         "--colour=red: unknown argument; the arguments are root, count, size, flag, codec."),
        (["root=x", "stray"], "argument 'stray' is not key=value. Fix: root=<value>"),
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
