"""The normalisation statistics of several datasets merged into one set, as LeRobot 0.6.1 merges them.

:func:`aggregate_stats` is LeRobot's ``lerobot.datasets.compute_stats.aggregate_stats``: per feature, over the
datasets that have it,
  mean = the count-weighted mean of the means,
  std = sqrt(sum_i count_i (std_i^2 + (mean_i - mean)^2) / sum_i count_i)  (the pooled variance),
  min = the min of the mins, max = the max of the maxes, count = the sum of the counts,
  q01, q10, q50, ... = the count-weighted mean of that quantile (kept when every dataset has it).
A camera's statistics keep their per-channel shape (3, 1, 1).

One extension: a vector feature whose length differs across datasets (a 14-dim ALOHA action, a 2-dim PushT action)
is merged dimension by dimension over the datasets that have that dimension, so the merged statistics of ALOHA's
dims 2..13 are ALOHA's alone; the result has the longest length, and its count is every dataset's.

:func:`pad_stats` lengthens one dataset's statistics to the merged lengths with values that make every
normalisation mode the identity on the added dimensions (mean 0, std 1, min -1, max 1, quantiles below the median
-1, above 1), so a zero there stays zero through the normaliser and the unnormaliser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Stats = dict[str, dict[str, np.ndarray]]
StatsLike = Mapping[str, Mapping[str, Any]]  # numpy arrays, CPU tensors or nested lists

_QUANTILE = re.compile(r"^q(\d+)$")
_PAD_VALUES = {"mean": 0.0, "std": 1.0, "min": -1.0, "max": 1.0}


def _as_arrays(stats: StatsLike) -> Stats:
    return {key: {name: np.asarray(value) for name, value in per_key.items()} for key, per_key in stats.items()}


def _check(stats: Stats) -> None:
    """LeRobot's checks of one dataset's statistics (``_validate_stat_value``)."""
    for key, per_key in stats.items():
        for name, value in per_key.items():
            if value.ndim == 0:
                raise ValueError(f"stats[{key!r}][{name!r}] is a scalar; statistics have at least one dimension")
            if name == "count" and value.shape != (1,):
                raise ValueError(f"stats[{key!r}]['count'] has the shape {value.shape}, not (1,)")
            if "image" in key and name != "count" and value.shape not in ((3, 1, 1), (1, 1, 1)):
                raise ValueError(f"stats[{key!r}][{name!r}] has the shape {value.shape}, not a camera's (3, 1, 1) "
                                 "or (1, 1, 1)")


def _aggregate_equal(per_source: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """LeRobot's ``aggregate_feature_stats``: one feature's statistics of equal shapes merged."""
    means = np.stack([s["mean"] for s in per_source])
    variances = np.stack([s["std"] ** 2 for s in per_source])
    counts = np.stack([s["count"] for s in per_source])
    total_count = counts.sum(axis=0)
    while counts.ndim < means.ndim:
        counts = np.expand_dims(counts, axis=-1)
    total_mean = (means * counts).sum(axis=0) / total_count
    total_variance = ((variances + (means - total_mean) ** 2) * counts).sum(axis=0) / total_count
    merged = {
        "min": np.min(np.stack([s["min"] for s in per_source]), axis=0),
        "max": np.max(np.stack([s["max"] for s in per_source]), axis=0),
        "mean": total_mean,
        "std": np.sqrt(total_variance),
        "count": total_count,
    }
    for name in per_source[0]:
        if _QUANTILE.match(name) and all(name in s for s in per_source):
            merged[name] = (np.stack([s[name] for s in per_source]) * counts).sum(axis=0) / total_count
    return merged


def _aggregate_feature(key: str, per_source: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    shapes = [s["mean"].shape for s in per_source]
    if len(set(shapes)) == 1:
        return _aggregate_equal(per_source)
    if any(len(shape) != 1 for shape in shapes):
        raise ValueError(f"stats[{key!r}] have the shapes {sorted(set(shapes))} across the datasets; only vectors "
                         "may differ (in length)")
    lengths = [shape[0] for shape in shapes]
    parts, start = [], 0
    for end in sorted(set(lengths)):  # dims [start, end) are in exactly the datasets at least `end` long
        members = [s for s, length in zip(per_source, lengths, strict=True) if length >= end]
        parts.append(_aggregate_equal([{name: value if name == "count" else value[start:end]
                                        for name, value in s.items()} for s in members]))
        start = end
    merged = {name: np.concatenate([part[name] for part in parts]) for name in parts[0] if name != "count"}
    merged["count"] = parts[0]["count"]  # the first dims are in every dataset
    return merged


def aggregate_stats(stats_list: Sequence[StatsLike]) -> Stats:
    """The statistics of several datasets merged into one set, LeRobot 0.6.1's ``aggregate_stats`` (see the module
    docstring): the union of the datasets' features, each merged over the datasets that have it, vectors of
    different lengths dimension by dimension. Values may be numpy arrays, CPU tensors or nested lists; the result's
    are numpy arrays. Raises ValueError on statistics LeRobot refuses (a scalar, a count not of shape (1,), a camera's
    not (3, 1, 1) or (1, 1, 1)) and on a non-vector feature whose shape differs across the datasets."""
    arrays = [_as_arrays(stats) for stats in stats_list]
    for stats in arrays:
        _check(stats)
    keys = list(dict.fromkeys(key for stats in arrays for key in stats))
    return {key: _aggregate_feature(key, [stats[key] for stats in arrays if key in stats]) for key in keys}


def pad_value(stat_name: str) -> float:
    """The value :func:`pad_stats` adds for a statistic: one that makes its normalisation mode the identity."""
    quantile = _QUANTILE.match(stat_name)
    if quantile is not None:
        return float(np.sign(int(quantile.group(1)) - 50))
    return _PAD_VALUES.get(stat_name, 0.0)


def pad_stats(stats: StatsLike, lengths: Mapping[str, int]) -> Stats:
    """``stats`` (one dataset's) with each vector feature named in ``lengths`` lengthened to that length by
    :func:`pad_value`'s values (the identity of every normalisation mode on the added dimensions); the count and
    the other features unchanged. Raises ValueError for a feature longer than its length."""
    out = _as_arrays(stats)
    for key, length in lengths.items():
        if key not in out:
            continue
        for name, value in out[key].items():
            if name == "count":
                continue
            if value.ndim != 1 or value.shape[0] > length:
                raise ValueError(f"stats[{key!r}][{name!r}] has the shape {value.shape}: not a vector of at most "
                                 f"{length} values")
            out[key][name] = np.concatenate([value, np.full(length - value.shape[0], pad_value(name), value.dtype)])
    return out
