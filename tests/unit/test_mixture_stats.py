"""A dataset mixture's normalisation statistics: LeRobot's aggregate_stats (per dimension for vectors of different
lengths), the per-source affine maps in front of the merged normaliser, and the per-source processor files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lerobot_mg.data.stats import aggregate_stats, pad_stats
from lerobot_mg.policies.act import ACTConfig
from lerobot_mg.processors import NormalizerStep, UnnormalizerStep, load_processors, make_processors
from lerobot_mg.processors.mixture import (
    load_source_processors,
    save_source_processors,
    source_affine,
    source_processors,
)

CAMERA = "observation.images.top"

# Three datasets' statistics and what LeRobot 0.6.1's own lerobot.datasets.compute_stats.aggregate_stats returned for
# them (run once in LeRobot's environment, the camera statistics as (3, 1, 1) arrays, the counts as int arrays; the
# numbers pasted here). The second dataset has no q10 for `action` and no `observation.state`.
LEROBOT_INPUTS = [
    {"action": {"mean": [-0.34, 0.41, 2.45], "std": [0.58, 1.22, 0.78], "min": [-3.34, -2.59, -0.55],
                "max": [2.16, 2.91, 4.95], "count": [120], "q01": [-2.84, -2.09, -0.05], "q10": [-1.34, -0.59, 1.45],
                "q50": [-0.24, 0.51, 2.55], "q90": [0.66, 1.41, 3.45], "q99": [1.66, 2.41, 4.45]},
     CAMERA: {"mean": [0.65, 0.53, 0.32], "std": [0.18, 0.11, 0.06], "min": [0.0, 0.0, 0.0], "max": [1.0, 1.0, 1.0],
              "count": [1200]},
     "observation.state": {"mean": [-2.32, -0.94], "std": [0.13, 1.57], "min": [-4.98, -8.9], "max": [6.63, 6.16],
                           "count": [120]}},
    {"action": {"mean": [-0.59, -2.57, 2.64], "std": [0.66, 1.87, 0.87], "min": [-3.59, -5.57, -0.36],
                "max": [1.91, -0.07, 5.14], "count": [45], "q01": [-3.09, -5.07, 0.14], "q50": [-0.49, -2.47, 2.74],
                "q90": [0.41, -1.57, 3.64], "q99": [1.41, -0.57, 4.64]},
     CAMERA: {"mean": [0.33, 0.35, 0.35], "std": [0.25, 0.26, 0.25], "min": [0.0, 0.0, 0.0], "max": [1.0, 1.0, 1.0],
              "count": [450]}},
    {"action": {"mean": [-1.4, -1.23, 0.23], "std": [1.45, 1.44, 1.7], "min": [-4.4, -4.23, -2.77],
                "max": [1.1, 1.27, 2.73], "count": [300], "q01": [-3.9, -3.73, -2.27], "q10": [-2.4, -2.23, -0.77],
                "q50": [-1.3, -1.13, 0.33], "q90": [-0.4, -0.23, 1.23], "q99": [0.6, 0.77, 2.23]},
     CAMERA: {"mean": [0.66, 0.51, 0.62], "std": [0.24, 0.1, 0.29], "min": [0.0, 0.0, 0.0], "max": [1.0, 1.0, 1.0],
              "count": [3000]},
     "observation.state": {"mean": [0.23, 0.81], "std": [1.38, 1.45], "min": [-8.56, -8.62], "max": [5.5, 4.66],
                           "count": [300]}},
]
LEROBOT_MERGED = {
    "action": {"count": [465], "max": [2.16, 2.91, 5.14],
               "mean": [-1.0480645161290323, -0.9364516129032258, 1.0361290322580645],
               "min": [-4.4, -5.57, -2.77],
               "q01": [-3.548064516129032, -3.436451612903226, -1.4638709677419355],
               "q50": [-0.9480645161290323, -0.8364516129032257, 1.1361290322580644],
               "q90": [-0.048064516129032245, 0.06354838709677416, 2.0361290322580645],
               "q99": [0.9519354838709677, 1.0635483870967744, 3.0361290322580645],
               "std": [1.309586044802286, 1.6858252471082882, 1.8107584891230861]},
    CAMERA: {"count": [4650], "max": [1.0, 1.0, 1.0], "min": [0.0, 0.0, 0.0],
             "mean": [0.6254838709677419, 0.4996774193548387, 0.5164516129032258],
             "std": [0.24686863046486132, 0.13634595161709984, 0.28424260863198303]},
    "observation.state": {"count": [420], "max": [6.63, 6.16], "min": [-8.56, -8.9],
                          "mean": [-0.4985714285714285, 0.3100000000000001],
                          "std": [1.6407788096025666, 1.682570312689148]},
}
MODES = ["MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10", "IDENTITY"]
FULL = 5  # the policy's state and action length; source B's are 3 long


def as_arrays(stats: dict) -> dict[str, dict[str, np.ndarray]]:
    """Lists as LeRobot's arrays: a camera's per-channel values (3, 1, 1), counts int."""
    return {key: {name: np.asarray(value).reshape(-1, 1, 1) if key == CAMERA and name != "count"
                  else np.asarray(value) for name, value in per_key.items()} for key, per_key in stats.items()}


def test_aggregate_stats_is_lerobots() -> None:
    merged = aggregate_stats([as_arrays(stats) for stats in LEROBOT_INPUTS])
    expected = as_arrays(LEROBOT_MERGED)
    assert merged.keys() == expected.keys()
    for key, per_key in expected.items():
        assert merged[key].keys() == per_key.keys(), key  # no q10: one dataset lacks it
        for name, value in per_key.items():
            assert merged[key][name].shape == value.shape, (key, name)
            np.testing.assert_allclose(merged[key][name], value, rtol=1e-12, atol=0, err_msg=f"{key}.{name}")


def test_vectors_of_different_lengths_merge_dimension_by_dimension() -> None:
    """A 3-dim and a 2-dim action: dims 0-1 are merged over both as LeRobot merges them, dim 2 is the first's."""
    long, short = (as_arrays(LEROBOT_INPUTS[i])["action"] for i in (0, 1))
    short = {name: value if name == "count" else value[:2] for name, value in short.items()}
    for order in ([long, short], [short, long]):
        merged = aggregate_stats([{"action": stats} for stats in order])["action"]
        head = aggregate_stats([{"action": {name: value if name == "count" else value[:2]
                                            for name, value in long.items()}}, {"action": short}])["action"]
        assert merged.keys() == head.keys() == {"mean", "std", "min", "max", "count", "q01", "q50", "q90", "q99"}
        np.testing.assert_array_equal(merged["count"], [165])
        for name in merged.keys() - {"count"}:
            assert merged[name].shape == (3,)
            np.testing.assert_allclose(merged[name][:2], head[name], rtol=1e-12, err_msg=name)
            np.testing.assert_allclose(merged[name][2], long[name][2], rtol=1e-12, err_msg=name)


@pytest.mark.parametrize(("stats", "problem"), [
    ({"action": {"mean": np.float64(1.0)}}, "scalar"),
    ({"action": {"mean": np.zeros(2), "count": np.array([1, 2])}}, "count"),
    ({CAMERA: {"mean": np.zeros(3)}}, "camera"),
])
def test_statistics_lerobot_refuses_are_refused(stats: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        aggregate_stats([stats])


def test_pad_stats_makes_every_mode_the_identity_on_the_added_dimensions() -> None:
    stats = as_arrays(LEROBOT_INPUTS[0])
    padded = pad_stats(stats, {"action": FULL})
    action = padded["action"]
    for name, value in {"mean": 0, "std": 1, "min": -1, "max": 1, "q01": -1, "q10": -1, "q50": 0, "q90": 1,
                        "q99": 1}.items():
        np.testing.assert_array_equal(action[name][:3], stats["action"][name])
        np.testing.assert_array_equal(action[name][3:], [value, value], err_msg=name)
    np.testing.assert_array_equal(action["count"], [120])
    assert padded["observation.state"]["mean"].shape == (2,)
    with pytest.raises(ValueError, match="at most 2"):
        pad_stats(stats, {"action": 2})


def random_stats(rng: np.random.Generator, length: int, count: int, constant: tuple[int, ...] = ()) -> dict:
    mean = rng.normal(0, 2, length)
    std = rng.uniform(0.2, 2, length)
    low, high = mean - rng.uniform(1, 3, length), mean + rng.uniform(1, 3, length)
    stats = {"mean": mean, "std": std, "min": low, "max": high, "count": np.array([count]),
             "q01": low + 0.1 * std, "q10": mean - std, "q50": mean, "q90": mean + std, "q99": high - 0.1 * std}
    for dim in constant:  # a joint that never moves in this dataset
        for name in stats.keys() - {"count"}:
            stats[name][dim] = mean[dim]
        stats["std"][dim] = 0.0
    return stats


def mixture(mode: str, seed: int = 0, constant: tuple[int, ...] = ()):
    """(the merged preprocessor and postprocessor, source A's stats (5 long), source B's (3 long))."""
    rng = np.random.default_rng(seed)
    sources = [{key: random_stats(rng, length, count, constant) for key in ("observation.state", "action")}
               for length, count in ((FULL, 500), (3, 200))]
    for stats in sources:
        stats[CAMERA] = {"mean": np.full((3, 1, 1), 0.5), "std": np.full((3, 1, 1), 0.2),
                         "min": np.zeros((3, 1, 1)), "max": np.ones((3, 1, 1)), "count": stats["action"]["count"]}
    config = ACTConfig(normalization_mapping={"VISUAL": "MEAN_STD", "STATE": mode, "ACTION": mode})
    inputs = {"observation.state": {"type": "STATE", "shape": [FULL]}, CAMERA: {"type": "VISUAL", "shape": [3, 4, 4]}}
    outputs = {"action": {"type": "ACTION", "shape": [FULL]}}
    pre, post = make_processors(config, inputs, outputs, aggregate_stats(sources))
    return pre, post, sources


def source_normaliser(pre, stats: dict, length: int) -> NormalizerStep:
    """The normaliser of a run on this source alone."""
    step = pre.step(NormalizerStep)
    features = {key: {**spec, "shape": [length]} if spec["type"] != "VISUAL" else spec
                for key, spec in step.features.items()}
    return NormalizerStep(features, step.norm_map, stats)


def sample(rng: np.random.Generator, stats: dict, length: int) -> dict:
    """A sample of the source: a state, an action chunk of 4 steps, a camera image."""
    def draw(key, shape):
        return torch.from_numpy((rng.normal(size=shape) * stats[key]["std"] + stats[key]["mean"]).astype(np.float32))
    return {"observation.state": draw("observation.state", (length,)), "action": draw("action", (4, length)),
            CAMERA: torch.rand(3, 4, 4), "index": torch.tensor(7)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_source", [True, False])
def test_the_affine_map_then_the_merged_normaliser_is_the_chosen_normalisation(mode: str, per_source: bool) -> None:
    pre, _, sources = mixture(mode)
    merged = pre.step(NormalizerStep)
    rng = np.random.default_rng(1)
    for stats, length in zip(sources, (FULL, 3)):
        affine = source_affine(pre, stats, per_source=per_source)
        assert affine.lengths == {"observation.state": length, "action": length}
        item = sample(rng, stats, length)
        mapped = affine.apply(item)
        assert mapped[CAMERA] is item[CAMERA] and mapped["index"] is item["index"]
        assert mapped["action"].shape == (4, FULL) and mapped["action"].dtype == torch.float32
        got = merged(mapped)
        if per_source:
            want = source_normaliser(pre, stats, length)(item)
        else:  # the merged statistics on the source's own dims
            want = merged({key: torch.nn.functional.pad(item[key], (0, FULL - length))
                           for key in ("observation.state", "action")})
        for key in ("observation.state", "action"):
            torch.testing.assert_close(got[key][..., :length], want[key][..., :length], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[key][..., length:], torch.zeros_like(got[key][..., length:]), atol=1e-5,
                                       rtol=0)
        # The same map on numpy arrays, and on vectors the dataset already zero-padded.
        as_numpy = affine.apply({key: item[key].numpy() for key in ("observation.state", "action")})
        padded = affine.apply({key: torch.nn.functional.pad(item[key], (0, FULL - length))
                               for key in ("observation.state", "action")})
        for key in ("observation.state", "action"):
            np.testing.assert_allclose(as_numpy[key], mapped[key].numpy(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(padded[key], mapped[key], rtol=0, atol=0)
        if not per_source:
            for key in ("observation.state", "action"):
                assert torch.equal(mapped[key][..., :length], item[key])  # untouched: bit for bit


@pytest.mark.parametrize("mode", ["MEAN_STD", "MIN_MAX", "QUANTILES"])
def test_a_joint_constant_in_one_source_normalises_as_that_sources_statistics_do(mode: str) -> None:
    """Source B's dim 1 never moves (std 0, min = max): per source, its value normalises as B's own statistics
    normalise it (0 for MEAN_STD, -1 for the range modes), not to a number blown up by the eps."""
    pre, _, sources = mixture(mode, seed=3, constant=(1,))
    b = sources[1]
    item = sample(np.random.default_rng(2), b, 3)
    item["observation.state"][1] = float(np.float32(b["observation.state"]["mean"][1]))
    item["action"][:, 1] = float(np.float32(b["action"]["mean"][1]))
    got = pre.step(NormalizerStep)(source_affine(pre, b, per_source=True).apply(item))
    want = source_normaliser(pre, b, 3)(item)
    for key in ("observation.state", "action"):
        assert torch.all(want[key][..., 1] == (0.0 if mode == "MEAN_STD" else -1.0))
        torch.testing.assert_close(got[key][..., :3], want[key], atol=1e-5, rtol=1e-5)


def test_per_source_processor_files_hold_the_sources_statistics(tmp_path: Path) -> None:
    """Written beside the default pair, one source's files load with its statistics (padded), normalise a robot's
    zero-padded vector as the training did through the affine map, and unnormalise back; the default pair keeps
    the merged statistics; the camera statistics are the run's."""
    pre, post, sources = mixture("MEAN_STD")
    b = sources[1]
    pre.save_pretrained(tmp_path)
    post.save_pretrained(tmp_path)
    save_source_processors(tmp_path, "lerobot_pusht", source_processors(pre, post, b))
    names = {path.name for path in tmp_path.iterdir()}
    assert {"policy_preprocessor_lerobot_pusht.json", "policy_postprocessor_lerobot_pusht.json",
            "policy_preprocessor_lerobot_pusht_step_3_normalizer_processor.safetensors",
            "policy_postprocessor_lerobot_pusht_step_0_unnormalizer_processor.safetensors"} <= names
    manifest = json.loads((tmp_path / "policy_preprocessor_lerobot_pusht.json").read_text())
    assert manifest["name"] == "policy_preprocessor"

    source_pre, source_post = load_source_processors(tmp_path, "lerobot_pusht")
    default_pre, _ = load_processors(tmp_path)
    padded = pad_stats(b, {"observation.state": FULL, "action": FULL})
    for step in (source_pre.step(NormalizerStep), source_post.step(UnnormalizerStep)):
        for name in ("mean", "std"):
            torch.testing.assert_close(step.stats["action"][name], torch.tensor(padded["action"][name],
                                                                                 dtype=torch.float32))
        torch.testing.assert_close(step.stats["observation.state"]["std"],
                                   torch.tensor(padded["observation.state"]["std"], dtype=torch.float32))
        torch.testing.assert_close(step.stats[CAMERA]["std"], pre.step(NormalizerStep).stats[CAMERA]["std"])
    torch.testing.assert_close(default_pre.step(NormalizerStep).stats["action"]["mean"],
                               pre.step(NormalizerStep).stats["action"]["mean"])

    item = sample(np.random.default_rng(4), b, 3)
    robot = {key: torch.nn.functional.pad(item[key], (0, FULL - 3)) for key in ("observation.state", "action")}
    deployed = source_pre.step(NormalizerStep)(robot)
    trained = pre.step(NormalizerStep)(source_affine(pre, b, per_source=True).apply(item))
    for key in ("observation.state", "action"):
        torch.testing.assert_close(deployed[key], trained[key], atol=1e-5, rtol=1e-5)
    restored = source_post({"action": deployed["action"]})["action"]
    torch.testing.assert_close(restored, robot["action"], atol=1e-5, rtol=1e-5)


def test_a_pipeline_file_stem_is_one_file_name(tmp_path: Path) -> None:
    pre, _, _ = mixture("MEAN_STD")
    with pytest.raises(ValueError, match="not a file name"):
        pre.save_pretrained(tmp_path, "../policy_preprocessor_x")


def test_an_observation_the_normaliser_leaves_is_left_on_the_sources_dims() -> None:
    """A saved LeRobot normaliser may normalise only some observations (``normalize_observation_keys``): the state
    it leaves stays the source's own values, per source as well, and its padded dims are 0."""
    pre, _, sources = mixture("MEAN_STD")
    step = pre.step(NormalizerStep)
    step.normalize_observation_keys = [CAMERA]
    b = sources[1]
    item = sample(np.random.default_rng(5), b, 3)
    got = step(source_affine(pre, b, per_source=True).apply(item))
    torch.testing.assert_close(got["observation.state"], torch.nn.functional.pad(item["observation.state"], (0, 2)))
    torch.testing.assert_close(got["action"][..., :3], source_normaliser(pre, b, 3)(item)["action"], atol=1e-5,
                               rtol=1e-5)
