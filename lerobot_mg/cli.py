"""One argument style for every console command besides training: ``key=value`` (Hydra's spelling) and
``--key=value`` (LeRobot's), read into the command's argument dataclass.

``lerobot-mg-train`` composes with Hydra, which takes both spellings too (``config/loading.normalize_argv``);
``lerobot_train_argv`` reads lerobot-train's names of the keys that are named differently here (``--eval_freq``,
``--save_checkpoint``, ``--wandb.mode``, ...) as ours, and refuses, naming the setting to type, LeRobot's switches
that have no key here (``--wandb.enable``).
Here a dataclass field is a key: its type converts the value (``true``/``false`` for flags, ``[a,b]`` or ``a,b``
for lists, ``null`` for an optional value) and ``metadata={"help": ...}`` documents it in ``--help``. The
spellings of argparse days still work: ``--key value``, ``--key a b`` for a list, a bare ``--flag``, dashes for
underscores. A field with ``metadata={"positional": True}`` also collects bare arguments (run directories).
Errors name the key, the bad value and the fix; the command exits with status 2.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lerobot_mg.errors import ConfigError, config_error

T = TypeVar("T")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
# lerobot-train's (LeRobot 0.6) names of keys that are named differently here, read as ours in either spelling
# (``--eval_freq=5`` or ``eval_freq=5``). eval_freq=0 evaluates at the last step only here (LeRobot: never); with
# nothing to evaluate (no eval.n_episodes, no dataset.val_episodes) no step evaluates.
LEROBOT_TRAIN_KEYS = {
    "eval_freq": "eval.freq",
    "save_checkpoint": "checkpoint.save_checkpoint",
    "save_freq": "checkpoint.save_freq",
    "wandb.mode": "logging.wandb.mode",
    "wandb.project": "logging.wandb.project",
    "wandb.entity": "logging.wandb.entity",
}
# LeRobot's wandb.enable has no key here: wandb always runs, as logging.wandb.mode says (offline by default, written
# on this machine and uploaded by nobody). Refused, naming the mode that does what LeRobot's value did: its enabled
# wandb logs online (its default mode), a disabled one logs nothing.
_WANDB_ENABLE = "wandb.enable"
_WANDB_MODE_OF_ENABLE = {True: "online", False: "disabled"}
# ``literal`` (reStructuredText), `code` (Markdown) and :role:`target` (Sphinx) in a docstring.
_MARKUP = re.compile(r"(?::\w+:)?(``?)([^`]+?)\1")


def run(args_type: type[T], body: Callable[[T], int | None], prog: str, doc: str | None = None,
        argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) into ``args_type``, call ``body``; returns the exit status.

    A ``ConfigError`` (a user error: a bad argument, a missing file) prints ``<prog>: error: ...`` and gives 2;
    any other exception keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(help_text(args_type, prog, doc))
        return 0
    try:
        return body(parse(args_type, argv)) or 0
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2


def lerobot_train_argv(argv: Sequence[str]) -> list[str]:
    """The training command line with lerobot-train's names of keys (``LEROBOT_TRAIN_KEYS``) written as ours
    (``key=value``, Hydra's spelling); every other argument as it was. Raises ``ConfigError`` for LeRobot's
    ``wandb.enable``, naming the ``logging.wandb.mode`` that does what its value did."""
    out = []
    for arg in argv:
        key, equals, value = arg.removeprefix("--").partition("=")
        if key == _WANDB_ENABLE and (equals or arg.startswith("--")):
            enabled = (value or "true").lower() not in _FALSE
            mode = _WANDB_MODE_OF_ENABLE[enabled]
            raise config_error(
                _WANDB_ENABLE, value or "true",
                "is LeRobot's switch: here wandb always runs as logging.wandb.mode says (offline by default: written "
                "on this machine, uploaded by nobody)",
                f"logging.wandb.mode={mode} (what LeRobot's wandb.enable={str(enabled).lower()} does)",
            )
        out.append(f"{LEROBOT_TRAIN_KEYS[key]}={value}" if equals and key in LEROBOT_TRAIN_KEYS else arg)
    return out


def parse(args_type: type[T], argv: Sequence[str]) -> T:
    fields = {f.name: f for f in dataclasses.fields(args_type)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(args_type)
    positional = next((name for name, f in fields.items() if f.metadata.get("positional")), None)
    raw: dict[str, list[str]] = {}
    position = 0
    while position < len(argv):
        arg = argv[position]
        position += 1
        if "=" in arg or arg.startswith("--"):
            key, equals, value = arg.removeprefix("--").partition("=")
            key = key.replace("-", "_")
            if key not in fields:
                raise ConfigError(f"{arg}: unknown argument. Fix: one of {', '.join(fields)} (key=value)")
            values = [value] if equals else []
            while not equals and position < len(argv) and _takes(hints[key], values, argv[position]):
                values.append(argv[position])
                position += 1
            raw[key] = values or ["true"]
        elif positional is not None:
            raw.setdefault(positional, []).append(arg)
        else:
            raise ConfigError(f"{arg}: is not key=value. Fix: {next(iter(fields))}=<value>")
    missing = [name for name, f in fields.items() if name not in raw and _required(f)]
    if missing:
        raise ConfigError(f"{missing[0]}=None: is required. Fix: {missing[0]}=<{_kind(hints[missing[0]])}>")
    return args_type(**{key: _convert(key, hints[key], values, fields[key]) for key, values in raw.items()})


def help_text(args_type: type, prog: str, doc: str | None) -> str:
    hints = typing.get_type_hints(args_type)
    lines = [f"usage: {prog} key=value ... (or --key=value)", "", plain_text(doc or args_type.__doc__ or ""), "",
             "keys:"]
    for f in dataclasses.fields(args_type):
        default = "required" if _required(f) else f"default: {_default(f)}"
        kind = "|".join(f.metadata["choices"]) if "choices" in f.metadata else _kind(hints[f.name])
        lines.append(f"  {f.name}=<{kind}>  ({default}) {f.metadata.get('help', '')}".rstrip())
    return "\n".join(lines)


def plain_text(doc: str) -> str:
    """A docstring as a terminal should show it: dedented, without the backticks of its markup, and the lines of a
    Markdown code block indented instead of fenced."""
    lines, in_code = [], False
    for line in inspect.cleandoc(doc).splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        else:
            lines.append(f"  {line}" if in_code else _MARKUP.sub(r"\2", line))
    return "\n".join(lines)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else value


def _optional(hint: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``, else (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return inner, True
    return hint, False


def _takes(hint: Any, values: list[str], token: str) -> bool:
    """Whether ``--key`` (no ``=``) takes ``token`` as its next value: ``--key value``, ``--key a b`` for a list,
    ``--flag true``; a bare ``--flag`` means true."""
    if "=" in token or token.startswith("--"):
        return False
    inner = _optional(hint)[0]
    if inner is bool:
        return not values and token.lower() in _TRUE + _FALSE
    return not values or typing.get_origin(inner) is list


def _kind(hint: Any) -> str:
    hint, _ = _optional(hint)
    if typing.get_origin(hint) is list:
        return f"[{_kind(typing.get_args(hint)[0])},...]"
    return {bool: "true|false", int: "int", float: "float", Path: "path"}.get(hint, "text")


def _convert(key: str, hint: Any, values: list[str], f: dataclasses.Field) -> Any:
    hint, optional = _optional(hint)
    if optional and values == ["null"]:
        return None
    if typing.get_origin(hint) is list:
        if len(values) == 1:  # key=[a,b] (Hydra) or key=a,b
            values = [item.strip() for item in values[0].strip("[]").split(",") if item.strip()]
        return [_convert(key, typing.get_args(hint)[0], [value], f) for value in values]
    (value,) = values
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(choices)}. Fix: {key}={choices[0]}")
    if hint is bool:
        if value.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{key}={value!r}: expected true or false. Fix: {key}=true")
        return value.lower() in _TRUE
    try:
        return hint(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected {_kind(hint)}. Fix: {key}=<{_kind(hint)}>") from None
