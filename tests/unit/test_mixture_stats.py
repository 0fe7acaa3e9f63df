"""A dataset mixture's normalisation statistics: LeRobot's aggregate_stats (per dimension for vectors of different
lengths); a training batch normalised through the run's own path (``normalise_sources``, the mixture's ``collate``,
the run's preprocessor) with the merged or each source's statistics; and the per-source processor files.

The mixtures here are two sources written by our writer: ``long`` (5-dim state and action, the policy's) and
``short`` (3 dims, its joint 1 never moves), each with a 4x4 camera."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from lerobot_mg.config.choices import DatasetName, MixtureStats
from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.schema import DatasetConfig, SourceConfig
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.data.mixture import MixtureDataset, plan_mixture
from lerobot_mg.data.stats import aggregate_stats, pad_stats
from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.policies.base import SOURCE_INDEX_KEY, delta_timestamps, features_from_dataset
from lerobot_mg.processors import (
    NormalizerStep,
    PolicyProcessorPipeline,
    UnnormalizerStep,
    load_processors,
    processors_for,
)
from lerobot_mg.processors.mixture import load_source_processors, normalise_sources, save_source_processors
from lerobot_mg.step import to_device

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
FULL = 5  # the policy's state and action length (source long's); source short's are 3 long
SHORT = 3
VECTORS = ("observation.state", "action")
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1" / "pi0_tiny" / "tiny_tokenizer"


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


def write_source(root: Path, length: int, seed: int, constant: tuple[int, ...] = ()) -> Path:
    """A source of 2 episodes of 8 frames: a state and an action of ``length`` dims and a 4x4 camera; the joints in
    ``constant`` never move. Its stats.json also gets q10/q90 (mean -/+ std; the writer computes q01/q99 only), so
    that every normalisation mode finds its statistics."""
    rng = np.random.default_rng(seed)
    features = {key: {"dtype": "float32", "shape": [length], "names": None} for key in VECTORS}
    features[CAMERA] = {"dtype": "image", "shape": [4, 4, 3], "names": ["height", "width", "channels"]}
    writer = LeRobotDatasetWriter(root, fps=10, features=features)
    for _ in range(2):
        for _ in range(8):
            frame = {"observation.state": (3 * rng.normal(size=length) + 1).astype(np.float32),
                     "action": (2 * rng.normal(size=length) - 1).astype(np.float32),
                     CAMERA: rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)}
            for dim in constant:
                frame["observation.state"][dim], frame["action"][dim] = 0.25, -0.5
            writer.add_frame(frame)
        writer.save_episode(task="push the block")
    writer.finalize()
    path = root / "meta" / "stats.json"
    stats = json.loads(path.read_text())
    for key in VECTORS:
        mean, std = np.asarray(stats[key]["mean"]), np.asarray(stats[key]["std"])
        stats[key].update(q10=(mean - std).tolist(), q90=(mean + std).tolist())
    path.write_text(json.dumps(stats))
    return root


@pytest.fixture(scope="module")
def source_roots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("mixture_sources")
    return [write_source(folder / "long", FULL, seed=0), write_source(folder / "short", SHORT, seed=1, constant=(1,))]


def open_mixture(roots: list[Path], mode: str = "MEAN_STD",
                 ) -> tuple[MixtureDataset, PolicyProcessorPipeline, PolicyProcessorPipeline]:
    """The mixture of ``roots`` as a pi0 run opens it, and the run's (preprocessor, postprocessor) on the mixture's
    merged statistics, built as train.py builds them, normalising the state and action with ``mode``."""
    config = PI0Config(observation_keys=["observation.state", CAMERA], chunk_size=4, n_action_steps=4,
                       tokenizer_name=str(TOKENIZER),
                       normalization_mapping={"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode})
    sources = [SourceConfig(root=str(root)) for root in roots]
    plan = plan_mixture(DatasetConfig(name=DatasetName.mixture, sources=sources),
                        [DatasetMeta.read(root) for root in roots], config)
    mixture = MixtureDataset(plan, functools.partial(delta_timestamps, config, plan.features),
                             [*config.observation_keys, "action"])
    inputs, outputs = features_from_dataset(mixture.features, config.observation_keys)
    pre, post = processors_for(config, SimpleNamespace(input_features=inputs, output_features=outputs),
                               mixture.stats, None)
    return mixture, pre, post


def train_batch(mixture: MixtureDataset, preprocessor: PolicyProcessorPipeline, indices: list[int],
                ) -> dict[str, torch.Tensor]:
    """What the policy receives for these global indices: the DataLoader's collate, then the run's preprocessor."""
    batch = mixture.collate([mixture[index] for index in indices])
    return preprocessor(to_device(batch, torch.device("cpu"), uint8_keys=[CAMERA]))


def source_normaliser(merged: NormalizerStep, stats: dict, length: int) -> NormalizerStep:
    """The normaliser of a run on this source alone."""
    features = {key: {**spec, "shape": [length]} if spec["type"] != "VISUAL" else spec
                for key, spec in merged.features.items()}
    return NormalizerStep(features, merged.norm_map, stats)


def own_vectors(mixture: MixtureDataset, index: int) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(source position, the source's length, its own state and action) of one global index."""
    item = mixture[index]
    return int(item[SOURCE_INDEX_KEY]), item["action"].shape[-1], {key: item[key] for key in VECTORS}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stats_mode", list(MixtureStats))
def test_a_training_batch_is_normalised_with_the_chosen_statistics(source_roots: list[Path], mode: str,
                                                                   stats_mode: MixtureStats) -> None:
    """``per_source``: each sample's real dims as its own source's statistics normalise them (a joint that never
    moves in ``short`` as its statistics normalise it, 0 for MEAN_STD, -1 for the range modes, not a number blown up
    by the eps); ``merged``: as the merged statistics do. Either way the padded dims are 0 and the camera is left."""
    mixture, pre, post = open_mixture(source_roots, mode)
    pipelines = normalise_sources(mixture, pre, post, stats_mode)
    assert pipelines.keys() == ({"long", "short"} if stats_mode is MixtureStats.per_source else set())
    merged = pre.step(NormalizerStep)
    short = int(mixture.offsets[1])
    indices = [short + 3, 0, short + 12, 9]  # the sources interleaved: each row is mapped by its source
    out = train_batch(mixture, pre, indices)
    assert out[SOURCE_INDEX_KEY].tolist() == [1, 0, 1, 0]
    for row, index in enumerate(indices):
        source, length, own = own_vectors(mixture, index)
        if stats_mode is MixtureStats.per_source:
            want = source_normaliser(merged, mixture.source_stats[source], length)(own)
            if source == 1 and mode != "IDENTITY":
                for key in VECTORS:
                    assert torch.all(want[key][..., 1] == (0.0 if mode == "MEAN_STD" else -1.0)), key
        else:
            want = merged({key: F.pad(value, (0, FULL - length)) for key, value in own.items()})
        for key in VECTORS:
            got = out[key][row]
            torch.testing.assert_close(got[..., :length], want[key][..., :length], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[..., length:], torch.zeros_like(got[..., length:]), atol=1e-5, rtol=0)
        assert torch.equal(out[CAMERA][row], mixture[index][CAMERA].float() / 255)
    if stats_mode is MixtureStats.merged:  # the merged map touches no real value: bit for bit the plain normaliser's
        for row, index in enumerate(indices):
            _, length, own = own_vectors(mixture, index)
            plain = merged({key: F.pad(value, (0, FULL - length)) for key, value in own.items()})
            for key in VECTORS:
                assert torch.equal(out[key][row][..., :length], plain[key][..., :length]), key


def test_per_source_processor_files_normalise_a_robot_as_its_training_did(source_roots: list[Path],
                                                                         tmp_path: Path) -> None:
    """Written beside the default pair, one source's files load with its statistics (padded), normalise the robot's
    zero-padded vectors as the training batch was normalised, and unnormalise back; the default pair keeps the
    merged statistics; the camera statistics are the run's."""
    mixture, pre, post = open_mixture(source_roots)
    pipelines = normalise_sources(mixture, pre, post, MixtureStats.per_source)
    pre.save_pretrained(tmp_path)
    post.save_pretrained(tmp_path)
    save_source_processors(tmp_path, "short", pipelines["short"])
    normaliser_step = pre.steps.index(pre.step(NormalizerStep))
    names = {path.name for path in tmp_path.iterdir()}
    assert {"policy_preprocessor_short.json", "policy_postprocessor_short.json",
            f"policy_preprocessor_short_step_{normaliser_step}_normalizer_processor.safetensors",
            "policy_postprocessor_short_step_0_unnormalizer_processor.safetensors"} <= names
    manifest = json.loads((tmp_path / "policy_preprocessor_short.json").read_text())
    assert manifest["name"] == "policy_preprocessor"

    source_pre, source_post = load_source_processors(tmp_path, "short")
    default_pre, _ = load_processors(tmp_path)
    padded = pad_stats(mixture.source_stats[1], dict.fromkeys(VECTORS, FULL))
    for step in (source_pre.step(NormalizerStep), source_post.step(UnnormalizerStep)):
        for name in ("mean", "std"):
            torch.testing.assert_close(step.stats["action"][name], torch.as_tensor(padded["action"][name],
                                                                                    dtype=torch.float32))
        torch.testing.assert_close(step.stats["observation.state"]["std"],
                                   torch.as_tensor(padded["observation.state"]["std"], dtype=torch.float32))
        if CAMERA in step.stats:
            torch.testing.assert_close(step.stats[CAMERA]["std"], pre.step(NormalizerStep).stats[CAMERA]["std"])
    assert CAMERA in source_pre.step(NormalizerStep).stats
    torch.testing.assert_close(default_pre.step(NormalizerStep).stats["action"]["mean"],
                               pre.step(NormalizerStep).stats["action"]["mean"])

    indices = [int(mixture.offsets[1]) + frame for frame in (0, 5, 11)]
    trained = train_batch(mixture, pre, indices)
    robot = {key: torch.stack([F.pad(own_vectors(mixture, index)[2][key], (0, FULL - SHORT)) for index in indices])
             for key in VECTORS}
    deployed = source_pre.step(NormalizerStep)(robot)
    for key in VECTORS:
        torch.testing.assert_close(deployed[key], trained[key], atol=1e-5, rtol=1e-5)
    restored = source_post({"action": deployed["action"]})["action"]
    torch.testing.assert_close(restored, robot["action"], atol=1e-5, rtol=1e-5)


def test_a_pipeline_file_stem_is_one_file_name(source_roots: list[Path], tmp_path: Path) -> None:
    _, pre, _ = open_mixture(source_roots)
    with pytest.raises(ValueError, match="not a file name"):
        pre.save_pretrained(tmp_path, "../policy_preprocessor_x")


def test_an_observation_the_normaliser_leaves_is_left_on_the_sources_dims(source_roots: list[Path]) -> None:
    """A saved LeRobot normaliser may normalise only some observations (``normalize_observation_keys``): the state
    it leaves stays the source's own values, per source as well, and its padded dims are 0."""
    mixture, pre, post = open_mixture(source_roots)
    step = pre.step(NormalizerStep)
    step.normalize_observation_keys = [CAMERA]
    normalise_sources(mixture, pre, post, MixtureStats.per_source)
    indices = [int(mixture.offsets[1]) + 2, 3]
    out = train_batch(mixture, pre, indices)
    for row, index in enumerate(indices):
        source, length, own = own_vectors(mixture, index)
        torch.testing.assert_close(out["observation.state"][row], F.pad(own["observation.state"], (0, FULL - length)))
        torch.testing.assert_close(out["action"][row][..., :length],
                                   source_normaliser(step, mixture.source_stats[source], length)(own)["action"],
                                   atol=1e-5, rtol=1e-5)
