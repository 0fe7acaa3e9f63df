"""Every user error in the package is written in the one style ``key=value: problem. Fix: override``.

The check reads the source with ``ast``: each ``ConfigError(...)`` whose message is written at the call (a string or
an f-string, possibly concatenated) must contain ``Fix: ``; each ``config_error(key, value, problem, fix)`` call
must pass all four parts (it renders the style itself) with a problem that does not end in a full stop (the helper
adds ``. Fix: ``). A call that passes a message built elsewhere, or wraps one, is allowed only when listed in
``WRAPPED`` with the reason its text already follows the style.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lerobot_mg"

NOT_YET_CHECKED: set[str] = set()  # every room of the package is checked

# (file, the message expression as written) -> why the text already follows the style.
WRAPPED = {
    ("checkpoint/disk.py", "self._message(tmp, f'{free:,} bytes free on its file system', short)"):
        "DiskGuard._message renders both disk errors, ending in 'Fix: free space ... or resume into another output_dir'",
    ("checkpoint/disk.py", "self._message(tmp, str(cause), self.needed_bytes)"):
        "DiskGuard._message renders both disk errors, ending in 'Fix: free space ... or resume into another output_dir'",
    ("sim/cli.py", "str(error)"):
        "the ImportError of sim.backend.require_sim, 'lerobot_mg[sim]: ... Fix: pip install ...'",
    ("launch/submitit_launcher.py", "f\"sweep job #{idx} ({' '.join(overrides)}): {error}\""):
        "prefixes the job to a ConfigError that preflight raised in the style",
}


def _unparsed(expression: str) -> str:
    """``expression`` as this Python's ``ast.unparse`` writes it (3.12 quotes an f-string otherwise than 3.11)."""
    return ast.unparse(ast.parse(expression, mode="eval").body)


WRAPPED_UNPARSED = {(file, _unparsed(expression)) for file, expression in WRAPPED}


def _checked_files() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in NOT_YET_CHECKED)


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _literal_parts(node: ast.expr) -> list[str] | None:
    """The text written at the call (the constant parts of a string, f-string or ``+`` of them); None when the
    message is an expression built elsewhere."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [value.value for value in node.values if isinstance(value, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_parts(node.left), _literal_parts(node.right)
        if left is None and right is None:
            return None
        return (left or []) + (right or [])
    return None


def _violations(path: Path, package: Path = PACKAGE) -> list[str]:
    relative = path.relative_to(package).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = _called_name(node)
        where = f"{relative}:{node.lineno}"
        if name == "ConfigError":
            if not node.args:
                found.append(f"{where}: ConfigError() without a message")
                continue
            parts = _literal_parts(node.args[0])
            if (relative, ast.unparse(node.args[0])) in WRAPPED_UNPARSED:
                continue
            if parts is None or not any(parts):
                found.append(f"{where}: ConfigError({ast.unparse(node.args[0])}) passes a message built "
                             "elsewhere; write it here or list it in WRAPPED with the reason")
            elif not any("Fix: " in part for part in parts):
                found.append(f"{where}: the message has no 'Fix: <override>'")
        elif name == "config_error" and relative != "errors.py":
            arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
            if any(isinstance(argument, ast.Starred) for argument in arguments):
                continue  # e.g. config_error(key, value, *(problem, fix)): the parts are built elsewhere
            if len(arguments) != 4:
                found.append(f"{where}: config_error takes key, value, problem and fix")
                continue
            problem = _literal_parts(node.args[2]) if len(node.args) > 2 else None
            if problem and problem[-1].rstrip().endswith("."):
                found.append(f"{where}: the problem ends in '.', the helper adds '. Fix: '")
    return found


def test_every_checked_file_is_parsed() -> None:
    files = {path.relative_to(PACKAGE).as_posix() for path in _checked_files()}
    assert "data/writer.py" in files and "sim/generate.py" in files
    assert not {file for file in files if file.split("/")[0] in NOT_YET_CHECKED}


def test_every_user_error_names_its_fix() -> None:
    violations = [violation for path in _checked_files() for violation in _violations(path)]
    assert not violations, "\n".join(violations)


def test_a_message_without_fix_is_caught(tmp_path: Path) -> None:
    source = (
        "from lerobot_mg.errors import ConfigError, config_error\n"
        "raise ConfigError(f'batch_size={1}: must be even')\n"
        "raise ConfigError('x=1: ok. Fix: x=2')\n"
        "raise ConfigError(message)\n"
        "raise config_error('x', 1, 'is odd.', 'x=2')\n"
    )
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    found = _violations(probe, tmp_path)
    assert [line.split(":")[1] for line in found] == ["2", "4", "5"], found


@pytest.mark.parametrize("entry", sorted(WRAPPED))
def test_every_wrapped_entry_is_still_in_the_source(entry: tuple[str, str]) -> None:
    file, expression = entry
    tree = ast.parse((PACKAGE / file).read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and _called_name(node) == "ConfigError"]
    assert any(call.args and ast.unparse(call.args[0]) == _unparsed(expression) for call in calls), entry
