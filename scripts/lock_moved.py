"""What moved since requirements/lock.txt: each package installed here at another version than the lock pins, and
each one the lock does not pin. `make test-latest` prints it after installing the newest versions pyproject.toml's
ranges allow, before it runs the tests; run by another venv's Python, it compares that venv. Its one argument: the
lock (default requirements/lock.txt).
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parent.parent / "requirements" / "lock.txt"


def lock_pins(lock: Path) -> dict[str, str]:
    """{canonical name: pinned version} of a lock written by `make lock`."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", lock.read_text(), re.MULTILINE)
    return {canonicalize_name(name): version for name, version in pins}


def main() -> None:
    lock = Path(sys.argv[1]) if len(sys.argv) > 1 else LOCK
    pinned = lock_pins(lock)
    installed = {canonicalize_name(dist.metadata["Name"]): dist.version for dist in distributions()}
    moved = [f"  {name}: {pinned[name]} -> {version}" for name, version in sorted(installed.items())
             if name in pinned and version != pinned[name]]
    new = [f"  {name}: {version}" for name, version in sorted(installed.items())
           if name not in pinned and name not in ("torch", "lerobot-mg", "pip")]
    print(f"moved since {lock.name}: {len(moved)} package(s)", *moved, sep="\n")
    if new:
        print(f"not in {lock.name}:", *new, sep="\n")


if __name__ == "__main__":
    main()
