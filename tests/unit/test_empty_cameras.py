"""``policy.empty_cameras`` as in LeRobot 0.6.1 (pi0, pi0.5, SmolVLA): the config lists
``observation.images.empty_camera_<i>``, which no dataset has; the policy fills it with -1 and masks it out. A run
trains with it from scratch and from a LeRobot base that has one (tests/fixtures/lerobot_0_6_1/pi05_tiny, written
by LeRobot with empty_cameras=1), and the checkpoint's config.json and processors name the empty camera as LeRobot
names it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.sim.env import IMAGE_KEY, NUM_JOINTS
from lerobot_mg.sim.evaluate import PolicyController
from tests import vla_fixtures as vf
from tests.launch_utils import interval_metrics, run_train
from tests.vla_preset_aids import IMAGE_SHAPE_HWC, PRESET_TEST_OVERRIDES, shared_vla_dataset

EMPTY = "observation.images.empty_camera_0"
STEPS = 2


def _normalizer(pretrained: Path) -> tuple[dict, list[str]]:
    """The preprocessor's normalizer step config and the features its statistics file holds."""
    steps = json.loads((pretrained / "policy_preprocessor.json").read_text())["steps"]
    (step,) = [step for step in steps if step["registry_name"] == "normalizer_processor"]
    with safe_open(str(pretrained / step["state_file"]), framework="pt") as stats:
        return step["config"], sorted({key.rsplit(".", 1)[0] for key in stats.keys()})  # noqa: SIM118 (not a dict)


@pytest.fixture(scope="module")
def vla_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_vla_dataset(tmp_path_factory)


# LeRobot's shape of the empty camera: SmolVLAConfig.validate_features writes (3, 480, 640); PI0Config's and
# PI05Config's (3, *image_resolution) (the tiny presets' 56x56).
@pytest.mark.parametrize(("preset", "empty_shape"), [("aloha_smolvla_tiny", [3, 480, 640]),
                                                      ("aloha_pi0_tiny", [3, 56, 56])])
def test_a_run_from_scratch_with_an_empty_camera(preset: str, empty_shape: list[int], vla_dataset: Path,
                                                 tmp_path: Path) -> None:
    """Trains (with a validation loss, which reads the held-out episode without the empty camera too); config.json
    and the normaliser list the empty camera after the dataset's inputs, its statistics hold none for it (as
    LeRobot's); the checkpoint acts in a rollout's controller, which the scene gives no such camera."""
    run_dir = tmp_path / "run"
    run_train([f"experiment={preset}", "dataset=lerobot", f"dataset.root={vla_dataset}", f"steps={STEPS}",
               *PRESET_TEST_OVERRIDES, "policy.empty_cameras=1", "dataset.val_episodes=[1]", "batch_size=4",
               f"eval.freq={STEPS}", f"output_dir={run_dir}"], timeout=240)
    records = interval_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and all(np.isfinite(r["loss"]) for r in records)
    pretrained = L.checkpoints_root(run_dir) / "last" / L.PRETRAINED_MODEL_DIR
    config = json.loads((pretrained / "config.json").read_text())
    assert config["empty_cameras"] == 1
    assert config["input_features"] == {
        "observation.state": {"type": "STATE", "shape": [NUM_JOINTS]},
        IMAGE_KEY: {"type": "VISUAL", "shape": [3, *IMAGE_SHAPE_HWC[:2]]},
        EMPTY: {"type": "VISUAL", "shape": empty_shape},
    }
    normalizer, with_stats = _normalizer(pretrained)
    assert normalizer["features"] == {**config["input_features"], **config["output_features"]}
    assert EMPTY not in with_stats and IMAGE_KEY in with_stats
    train_config = json.loads((pretrained / L.TRAIN_CONFIG_JSON).read_text())
    assert train_config["policy"]["observation_keys"] == ["observation.state", IMAGE_KEY]

    controller = PolicyController.load(pretrained)
    rng = np.random.default_rng(0)
    action = controller.act({"observation.state": rng.normal(size=NUM_JOINTS).astype(np.float32),
                             IMAGE_KEY: rng.integers(0, 256, size=IMAGE_SHAPE_HWC, dtype=np.uint8)})
    assert action.shape == (NUM_JOINTS,) and np.isfinite(action).all()


def _pi05_base(tmp_path: Path) -> Path:
    """A copy of LeRobot's pi05_tiny (empty_cameras=1) with its tiny sizes recorded for lerobot_mg and its tokenizer
    named by a path that exists from any folder."""
    base = vf.loadable_pretrained_copy("pi05_tiny", tmp_path,
                                       {"dimension_overrides": vf.pi_dimension_overrides("pi05_tiny")})
    preprocessor = json.loads((base / "policy_preprocessor.json").read_text())
    for step in preprocessor["steps"]:
        if "tokenizer_name" in step["config"]:
            step["config"]["tokenizer_name"] = str(vf.resolve_fixture_path(step["config"]["tokenizer_name"]))
    (base / "policy_preprocessor.json").write_text(json.dumps(preprocessor, indent=2))
    return base


def _dataset_like_the_base(root: Path, config: dict) -> Path:
    """Two episodes of 12 frames with the base's dataset inputs (no empty camera) and a task each."""
    shapes = {key: spec["shape"] for key, spec in {**config["input_features"], **config["output_features"]}.items()
              if key != EMPTY}
    features = {key: ({"dtype": "video", "shape": [shape[1], shape[2], shape[0]],
                       "names": ["height", "width", "channels"]} if len(shape) == 3
                      else {"dtype": "float32", "shape": shape, "names": None}) for key, shape in shapes.items()}
    writer = LeRobotDatasetWriter(root, fps=10, features=features, robot_type="so100")
    rng = np.random.default_rng(0)
    for episode in range(2):
        for step in range(12):
            writer.add_frame({key: np.full(spec["shape"], 8 * step + 60 * episode, dtype=np.uint8)
                              if spec["dtype"] == "video" else rng.normal(size=spec["shape"]).astype(np.float32)
                              for key, spec in features.items()})
        writer.save_episode(task="pick up the cube")
    writer.finalize()
    return root


def test_a_lerobot_base_with_an_empty_camera_fine_tunes(tmp_path: Path) -> None:
    """policy.path=<LeRobot's pi05_tiny>: the dataset gives the base's other inputs; the checkpoint's config.json
    and normaliser name the empty camera exactly as LeRobot's did."""
    base = _pi05_base(tmp_path)
    lerobots = json.loads((base / "config.json").read_text())
    assert lerobots["empty_cameras"] == 1 and EMPTY in lerobots["input_features"]
    dataset = _dataset_like_the_base(tmp_path / "dataset", lerobots)
    run_dir = tmp_path / "run"
    run_train([f"policy.path={base}", "dataset=lerobot", f"dataset.root={dataset}", f"steps={STEPS}", "batch_size=2",
               "eval.n_episodes=0", "logging.progress_bar=false", "logging.wandb.mode=disabled", "log_freq=1",
               f"output_dir={run_dir}"], timeout=240)
    assert all(np.isfinite(record["loss"]) for record in interval_metrics(run_dir))
    pretrained = L.checkpoints_root(run_dir) / "last" / L.PRETRAINED_MODEL_DIR
    ours = json.loads((pretrained / "config.json").read_text())
    assert ours["empty_cameras"] == 1
    assert ours["input_features"] == lerobots["input_features"]
    assert list(ours["input_features"]) == list(lerobots["input_features"])
    normalizer, with_stats = _normalizer(pretrained)
    lerobots_normalizer, lerobots_stats = _normalizer(base)
    assert normalizer["features"] == lerobots_normalizer["features"]
    assert with_stats == lerobots_stats and EMPTY not in with_stats
