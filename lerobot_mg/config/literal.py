"""Values read from files (a base policy's config.json, a resumed train_config.json, ...) kept as literal text when
they enter an OmegaConf config.

OmegaConf resolves ``${...}`` in any string it holds: a downloaded config.json whose ``license`` reads
``${oc.env:HF_TOKEN}`` would otherwise become the user's token in the run's config, its files, its tracker and its
upload, and one naming an unset variable would stop the start deep inside OmegaConf. :func:`literal_values` escapes
such strings the way OmegaConf's grammar reads them back, so that resolving gives the exact text of the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lerobot_mg.errors import ConfigError

# A run of backslashes, then "${": OmegaConf reads 2n backslashes there as n backslashes and an interpolation, 2n+1 as
# n backslashes and the literal text "${".
_BEFORE_INTERPOLATION = re.compile(r"(\\*)\$\{")


def literal_string(text: str) -> str:
    """``text`` escaped so that OmegaConf resolves it to ``text`` itself (unchanged when it holds no ``${``)."""
    return _BEFORE_INTERPOLATION.sub(lambda match: "\\" * (2 * len(match.group(1)) + 1) + "${", text)


def literal_values(data: Any, source: Path | str, key: str = "") -> Any:
    """``data`` (JSON-like values from a file someone else may have written) with every string, at any depth, escaped
    by :func:`literal_string`; keys are left as they are (OmegaConf never resolves a key). OmegaConf's missing-value
    marker ``???`` has no escape and is refused: :class:`ConfigError` naming ``source`` and the dotted ``key``."""
    if isinstance(data, dict):
        return {name: literal_values(value, source, f"{key}.{name}" if key else str(name))
                for name, value in data.items()}
    if isinstance(data, list | tuple):
        return [literal_values(value, source, f"{key}[{index}]") for index, value in enumerate(data)]
    if isinstance(data, str):
        if data == "???":
            raise ConfigError(f"{source}: {key}='???' is OmegaConf's marker of a missing value, which no saved config "
                              "holds. Fix: a config file written by lerobot_mg or LeRobot 0.6.1 (or give the field a "
                              "value)")
        return literal_string(data)
    return data
