"""Values read from files (a base policy's config.json, a resumed train_config.json, ...) kept as literal text when
they enter an OmegaConf config.

OmegaConf resolves ``${...}`` in any string it holds: a downloaded config.json whose ``license`` reads
``${oc.env:HF_TOKEN}`` would otherwise become the user's token in the run's config, its files, its tracker and its
upload, and one naming an unset variable would stop the start deep inside OmegaConf. :func:`literal_strings` escapes
such strings the way OmegaConf's grammar reads them back, so that resolving gives the exact text of the file.
"""

from __future__ import annotations

import re
from typing import Any

# A run of backslashes, then "${": OmegaConf reads 2n backslashes there as n backslashes and an interpolation, 2n+1 as
# n backslashes and the literal text "${".
_BEFORE_INTERPOLATION = re.compile(r"(\\*)\$\{")


def literal_string(text: str) -> str:
    """``text`` escaped so that OmegaConf resolves it to ``text`` itself (unchanged when it holds no ``${``)."""
    return _BEFORE_INTERPOLATION.sub(lambda match: "\\" * (2 * len(match.group(1)) + 1) + "${", text)


def literal_strings(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, scalars) with every string, at any depth, escaped by
    :func:`literal_string`; keys are left as they are (OmegaConf never resolves a key)."""
    if isinstance(value, str):
        return literal_string(value)
    if isinstance(value, dict):
        return {key: literal_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [literal_strings(item) for item in value]
    return value
