"""LeRobot 0.6.1's pretrained_model/ format, both ways, against the fixtures LeRobot wrote (tests/fixtures/lerobot_0_6_1,
PROVENANCE.md there).

Out: a checkpoint of ours holds LeRobot's files, a config.json with LeRobot's fields for the policy type and nothing
else (ours live in train_config.json), and LeRobot's state_dict. In: a LeRobot pretrained_model/ (a directory, or a
Hub repo id in huggingface_hub's cache, offline) is a base for full fine-tuning and for LoRA; loading is strict, a
missing or unexpected key stops the run naming it. The sharded runs on a LeRobot base are in
tests/dist/test_lerobot_base.py.

``PENDING`` lists what the other parts of the interop work still change (LeRobot's ACT / Diffusion fields and
state_dict names, LeRobot's processor files). Each entry is checked as it is today, exactly, so that the day it
lands the check fails and says to empty the entry: from then on the assertion is exact equality with the fixture.
"""

from __future__ import annotations

import json
import shutil
import typing
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.act import ACTConfig
from lerobot_mg.config.diffusion import DiffusionConfig
from lerobot_mg.config.policy import PolicyConfig
from lerobot_mg.config.schema import policy_config_class
from lerobot_mg.data.writer import LeRobotDatasetWriter
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import adapter_base_path, apply_policy_path
from lerobot_mg.policies.act import ACTPolicy
from lerobot_mg.policies.registry import get_policy_class
from lerobot_mg.policies.saved_config import lerobot_config_dict, read_saved_policy
from lerobot_mg.processors.normalize import make_processors
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.unit.test_config import _compose

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1"
HUB_REPO_ID = "lerobot_mg/act_state"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"

# LeRobot fields a config class of ours does not have yet (the ACT part of the interop work adds them).
PENDING_FIELDS: dict[str, frozenset[str]] = {
    "act": frozenset(),
    "diffusion": frozenset(),
}
# True for a fixture whose state_dict (names, shapes, dtypes) our model does not build yet from its config.json.
PENDING_STATE_DICT = {"act_state": False, "act_image": False, "diffusion_image": False}
# True while our processor files do not have LeRobot's step file names and JSON.
PENDING_PROCESSOR_FILES = False
# A field whose default differs on purpose: LeRobot's is torchvision's ImageNet weights (a download); ours null.
NULL_BY_CHOICE = {"pretrained_backbone_weights"}
# LeRobot types it int with the default False: it writes false, and 0 once draccus has read it back (act_state_lora).
# Ours is a bool (0 and 1 read as false and true) and writes false or true, which LeRobot reads as well.
BOOL_FOR_INT = {"replace_final_stride_with_dilation"}


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "pretrained_model" / "config.json").read_text())


def without_pending(config: dict) -> dict:
    return {key: value for key, value in config.items() if key not in PENDING_FIELDS[config["type"]]}


def manifest(state_dict: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    return [(key, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for key, tensor in state_dict.items()]


def fixture_manifest(name: str) -> list[tuple[str, list[int], str]]:
    keys = json.loads((FIXTURES / name / "state_dict_manifest.json").read_text())["keys"]
    return [(entry["key"], entry["shape"], entry["dtype"]) for entry in keys]


def lerobot_base(directory: Path, name: str = "act_state") -> Path:
    """A copy of the fixture's pretrained_model/ as a base (with what is still ``PENDING`` stood in for: the fields
    our config lacks left out, weights of our model on that config, our processor files on the fixture's stats)."""
    shutil.copytree(FIXTURES / name / "pretrained_model", directory)
    config = fixture_config(name)
    (directory / "config.json").write_text(json.dumps(without_pending(config), indent=4))
    policy_class = get_policy_class(config["type"])
    policy_config, inputs, outputs = policy_class.read_config(directory)
    if PENDING_STATE_DICT[name]:
        torch.manual_seed(0)
        policy = policy_class(policy_config, inputs, outputs)
        save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
    if PENDING_PROCESSOR_FILES:
        for old in directory.glob("policy_*processor*"):
            old.unlink()
        stats = json.loads((FIXTURES / name / "dataset_stats.json").read_text())
        for pipeline in make_processors(policy_config, inputs, outputs, stats):
            pipeline.save_pretrained(directory)
    return directory


def write_fixture_dataset(root: Path) -> Path:
    """A dataset written by our writer with the act_state fixture's features: state, environment state and action,
    14 dims each, 2 episodes."""
    features = {key: {"dtype": "float32", "shape": [14], "names": None}
                for key in ("observation.state", "observation.environment_state", "action")}
    writer = LeRobotDatasetWriter(root, fps=30, features=features, robot_type="interop")
    rng = np.random.default_rng(0)
    for _episode in range(2):
        for _ in range(24):
            writer.add_frame({key: rng.standard_normal(14).astype(np.float32) for key in features})
        writer.save_episode("interop")
    writer.finalize()
    return root


def json_type(value: object) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value), "null")


def assert_lerobot_config(ours: dict, theirs: dict) -> None:
    """``ours`` has exactly LeRobot's keys for the type (less what is pending), ``type`` first, and each value of a
    JSON type LeRobot writes there (null only where the field is optional)."""
    config_class = policy_config_class(theirs["type"])
    assert next(iter(ours)) == "type" and ours["type"] == theirs["type"]
    assert set(ours) == set(without_pending(theirs))
    hints = typing.get_type_hints(config_class)
    for key, value in ours.items():
        if key in hints and value is None:
            assert type(None) in typing.get_args(hints[key]), key
        elif key in BOOL_FOR_INT:
            assert json_type(value) == "bool" and value == theirs[key], key
        elif theirs[key] is not None or key not in NULL_BY_CHOICE:
            assert json_type(value) == json_type(theirs[key]) or (value, theirs[key]) == (None, None), key


# --- config.json: LeRobot's fields in, the same fields out -----------------------------------------------------


@pytest.mark.parametrize("config_class", [PolicyConfig, ACTConfig, DiffusionConfig])
def test_lerobot_mg_only_fields_are_fields_of_the_class(config_class: type[PolicyConfig]) -> None:
    names = {item.name for item in fields(config_class)}
    assert {"path", "observation_keys", "vision_channels"} <= config_class.lerobot_mg_only_fields <= names


@pytest.mark.parametrize("name", ["act_state", "act_image", "act_state_lora", "diffusion_image"])
def test_a_lerobot_config_json_reads_into_our_config_and_writes_back_the_same(name: str, tmp_path: Path) -> None:
    theirs = fixture_config(name)
    directory = tmp_path / "pretrained_model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(without_pending(theirs), indent=4))
    policy_class = get_policy_class(theirs["type"])
    config, inputs, outputs = policy_class.read_config(directory)
    assert (inputs, outputs) == (theirs["input_features"], theirs["output_features"])
    assert config.device == "cpu" and config.use_amp is False  # LeRobot's, kept though not acted on
    assert config.use_peft is (name == "act_state_lora")
    assert config.observation_keys is None and config.path is None  # no train_config.json of ours: the defaults
    written = lerobot_config_dict(config, inputs, outputs)
    assert written == without_pending(theirs)
    assert_lerobot_config(written, theirs)


def test_lerobot_mg_only_fields_come_back_from_train_config_json(tmp_path: Path) -> None:
    config = ACTConfig(chunk_size=10, n_action_steps=10, dim_model=16, n_heads=2, dim_feedforward=32,
                       observation_keys=["observation.state"], vision_channels=[4, 8], device="cuda", use_amp=True)
    policy = ACTPolicy(config, {"observation.state": {"type": "STATE", "shape": [2]}},
                       {"action": {"type": "ACTION", "shape": [2]}})
    policy.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not set(saved) & ACTConfig.lerobot_mg_only_fields
    assert (saved["device"], saved["use_amp"]) == ("cuda", True)
    assert (tmp_path / "config.json").read_text() == json.dumps(saved, indent=4)  # LeRobot's indent, no newline
    # Without train_config.json (a LeRobot checkpoint) they take their defaults; with ours, its policy section.
    assert read_saved_policy(tmp_path).values.keys() == saved.keys() - {"type", "input_features", "output_features"}
    (tmp_path / L.TRAIN_CONFIG_JSON).write_text(json.dumps({"policy": {
        "path": None, "observation_keys": ["observation.state"], "vision_channels": [4, 8], "dim_model": 999}}))
    loaded, _, _ = ACTPolicy.read_config(tmp_path)
    assert loaded == config  # dim_model=999 is not read: config.json holds the LeRobot fields


def test_booleans_written_as_integers_and_unknown_fields(tmp_path: Path) -> None:
    """LeRobot writes an int-typed field whose default is False as `0` once draccus has re-saved it; a field the
    policy does not have is refused, as LeRobot refuses it."""
    directory = tmp_path / "pretrained_model"
    directory.mkdir()
    config = without_pending(fixture_config("act_state"))
    (directory / "config.json").write_text(json.dumps({**config, "pre_norm": 1, "use_vae": 0, "n_heads": 4}))
    loaded, _, _ = ACTPolicy.read_config(directory)
    assert (loaded.pre_norm, loaded.use_vae) == (True, False)
    (directory / "config.json").write_text(json.dumps({**config, "not_a_field": 1}))
    with pytest.raises(ConfigError, match=r"has fields \['not_a_field'\] that ACTConfig lacks .*\. Fix: "):
        ACTPolicy.read_config(directory)
    (directory / "config.json").write_text(json.dumps({**config, "dim_model": "wide"}))
    with pytest.raises(ConfigError, match=r"policy\.dim_model does not fit ACTConfig .*\. Fix: "):
        ACTPolicy.read_config(directory)
    (directory / "config.json").write_text(json.dumps({key: v for key, v in config.items() if key != "type"}))
    with pytest.raises(ConfigError, match=r"has no 'type' field.*\. Fix: "):
        ACTPolicy.read_config(directory)


@pytest.mark.parametrize("name", ["act_state", "act_image", "diffusion_image"])
def test_state_dict_manifest_of_our_model_on_the_fixture_config(name: str, tmp_path: Path) -> None:
    directory = tmp_path / "pretrained_model"
    directory.mkdir()
    theirs = fixture_config(name)
    (directory / "config.json").write_text(json.dumps(without_pending(theirs)))
    policy_class = get_policy_class(theirs["type"])
    ours = manifest(policy_class(*policy_class.read_config(directory)).state_dict())
    if PENDING_STATE_DICT[name]:
        assert ours != fixture_manifest(name), f"our {name} state_dict is LeRobot's now: set PENDING_STATE_DICT false"
    else:
        assert ours == fixture_manifest(name)


# --- a fresh checkpoint of ours against the fixtures -----------------------------------------------------------


@pytest.fixture(scope="module")
def our_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """pretrained_model/ of a 2-step ACT run and of a 2-step Diffusion run (state inputs, the PushT slice)."""
    runs = {}
    for policy_type, experiment in (("act", "pusht_debug"), ("diffusion", "pusht_debug_diffusion")):
        run_dir = tmp_path_factory.mktemp(policy_type) / "run"
        run_train([*TINY_RUN, f"experiment={experiment}", "steps=2", "batch_size=4", "checkpoint.save_freq=2",
                   f"output_dir={run_dir}"])
        runs[policy_type] = run_dir / "checkpoints" / "last" / "pretrained_model"
    return runs


@pytest.mark.parametrize(("policy_type", "name"), [("act", "act_state"), ("diffusion", "diffusion_image")])
def test_our_checkpoint_has_lerobots_files_and_config_fields(our_checkpoints: dict[str, Path], policy_type: str,
                                                             name: str) -> None:
    pretrained = our_checkpoints[policy_type]
    ours_files = {path.name for path in pretrained.iterdir()}
    theirs_files = {path.name for path in (FIXTURES / name / "pretrained_model").iterdir()} | {"model.safetensors"}
    def not_processors(files: set[str]) -> set[str]:
        return {file for file in files if not file.startswith("policy_")}

    assert not_processors(ours_files) == not_processors(theirs_files)
    assert {"policy_preprocessor.json", "policy_postprocessor.json"} <= ours_files
    if PENDING_PROCESSOR_FILES:
        assert ours_files != theirs_files, "our processor files are LeRobot's now: set PENDING_PROCESSOR_FILES false"
    else:
        assert ours_files == theirs_files
    ours = json.loads((pretrained / "config.json").read_text())
    assert_lerobot_config(ours, fixture_config(name))
    assert ours["pretrained_path"] is None and ours["use_peft"] is False
    train_config = json.loads((pretrained / L.TRAIN_CONFIG_JSON).read_text())
    assert train_config["policy"]["observation_keys"] == ["observation.state"]  # ours live there


# --- a LeRobot pretrained_model/ as the base ------------------------------------------------------------------


def _hub_cache(hf_home: Path, base: Path) -> Path:
    """huggingface_hub's cache layout (models--<user>--<name>/refs/main -> snapshots/<commit>/) holding ``base``."""
    repo = hf_home / "hub" / f"models--{HUB_REPO_ID.replace('/', '--')}"
    shutil.copytree(base, repo / "snapshots" / HUB_COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    return repo / "snapshots" / HUB_COMMIT


def test_policy_path_to_a_lerobot_base_takes_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = lerobot_base(tmp_path / "pretrained_model")
    overrides = [*TINY_RUN, f"dataset.root={PUSHT_SLICE}", f"policy.path={base}", "policy.dropout=0.0"]
    policy = apply_policy_path(_compose(overrides), overrides).policy
    saved = without_pending(fixture_config("act_state"))
    assert (policy.dim_model, policy.chunk_size, policy.dropout, policy.device) == (saved["dim_model"], 10, 0.0, "cpu")
    assert policy.observation_keys == list(saved["input_features"])  # what the base reads, not pusht_debug's keys
    assert (policy.path, policy.pretrained_path, policy.use_peft) == (str(base), str(base), False)
    assert dict(policy.normalization_mapping) == saved["normalization_mapping"]  # no ENV entry: left unchanged

    snapshot = _hub_cache(tmp_path / "hf", base)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    overrides = [*TINY_RUN, f"dataset.root={PUSHT_SLICE}", f"policy.path={HUB_REPO_ID}", "peft=lora"]
    policy = apply_policy_path(_compose(overrides), overrides).policy
    assert (policy.path, policy.pretrained_path, policy.use_peft) == (str(snapshot), HUB_REPO_ID, True)


@pytest.fixture(scope="module")
def fixture_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture_dataset(tmp_path_factory.mktemp("interop") / "dataset")


FINETUNE = [*TINY_RUN, "steps=2", "batch_size=4", "checkpoint.save_freq=2", "log_freq=1"]


def test_full_fine_tune_of_a_lerobot_base_given_as_a_hub_repo_id_offline(fixture_dataset: Path, tmp_path: Path) -> None:
    base = lerobot_base(tmp_path / "base" / "pretrained_model")
    _hub_cache(tmp_path / "hf", base)
    run_dir = tmp_path / "run"
    run_train([*FINETUNE, f"dataset.root={fixture_dataset}", f"policy.path={HUB_REPO_ID}", f"output_dir={run_dir}"],
              env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1"})
    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    ours = json.loads((pretrained / "config.json").read_text())
    base_config = json.loads((base / "config.json").read_text())
    # LeRobot's config in, LeRobot's config out; where it publishes (push_to_hub, repo_id) is this run's own.
    assert ours == {**base_config, "pretrained_path": HUB_REPO_ID, "push_to_hub": True}
    trained, start = load_file(str(pretrained / "model.safetensors")), load_file(str(base / "model.safetensors"))
    assert manifest(trained) == manifest(start)
    assert any(not torch.equal(trained[key], start[key]) for key in start)  # it trained from there


def test_lora_on_a_lerobot_base_directory(fixture_dataset: Path, tmp_path: Path) -> None:
    base = lerobot_base(tmp_path / "base" / "pretrained_model")
    run_dir = tmp_path / "run"
    run_train([*FINETUNE, f"dataset.root={fixture_dataset}", f"policy.path={base}", "peft=lora", "peft.r=4",
               f"output_dir={run_dir}"])
    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    assert (pretrained / L.ADAPTER_SAFETENSORS).is_file() and not (pretrained / L.MODEL_SAFETENSORS).exists()
    adapter_config = json.loads((pretrained / L.ADAPTER_CONFIG_JSON).read_text())
    assert adapter_config["base_model_name_or_path"] == str(base.resolve())
    ours = json.loads((pretrained / "config.json").read_text())
    assert ours == {**json.loads((base / "config.json").read_text()), "use_peft": True, "pretrained_path": str(base),
                    "push_to_hub": True}


def test_a_missing_or_unexpected_key_stops_the_run_naming_them(fixture_dataset: Path, tmp_path: Path) -> None:
    base = lerobot_base(tmp_path / "pretrained_model")
    weights = load_file(str(base / "model.safetensors"))
    weights["model.not_a_tensor"] = weights.pop("model.action_head.bias")
    save_file(weights, str(base / "model.safetensors"))
    done = run_train([*FINETUNE, f"dataset.root={fixture_dataset}", f"policy.path={base}",
                      f"output_dir={tmp_path / 'run'}"], check=False, env={"HYDRA_FULL_ERROR": "0"})
    assert done.returncode == 2, done.stdout[-3000:]
    assert (f"{base / 'model.safetensors'}: does not match the policy built from {base / 'config.json'}: missing keys "
            "['model.action_head.bias'], unexpected keys ['model.not_a_tensor']. Fix: ") in done.stdout, done.stdout[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()



def test_a_lerobot_adapters_relative_base_path_resolves_as_lerobot_wrote_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """LeRobot records --policy.path as typed, relative to where lerobot-train ran: it is found from that folder (the
    current directory, as PEFT and LeRobot read it), never by searching the adapter's parent folders."""
    lora = shutil.copytree(FIXTURES / "act_state_lora", tmp_path / "act_state_lora")
    shutil.copytree(FIXTURES / "act_state", tmp_path / "act_state")
    recorded = json.loads((lora / "pretrained_model" / L.ADAPTER_CONFIG_JSON).read_text())["base_model_name_or_path"]
    assert recorded == "act_state/pretrained_model"
    monkeypatch.chdir(tmp_path)
    assert adapter_base_path(lora / "pretrained_model") == str(tmp_path / "act_state" / "pretrained_model")


def test_a_base_value_of_the_wrong_type_is_named_before_it_becomes_the_runs(tmp_path: Path) -> None:
    base = lerobot_base(tmp_path / "pretrained_model")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "n_heads": "four"}, indent=4))
    overrides = [*TINY_RUN, f"dataset.root={PUSHT_SLICE}", f"policy.path={base}"]
    with pytest.raises(ConfigError, match=rf"^{base / 'config.json'}: policy\.n_heads does not fit ACTConfig .*Fix: "):
        apply_policy_path(_compose(overrides), overrides)


def test_config_json_names_lerobots_backbone_when_the_policy_builds_none() -> None:
    """Our small CNN is lerobot_mg's only, but a policy without a camera builds no backbone at all: its config.json
    says LeRobot's resnet18, so LeRobot loads it; with a camera the name stays (LeRobot could not build it)."""
    config = ACTConfig(vision_backbone="lerobot_mg_cnn")
    state = {"observation.state": {"type": "STATE", "shape": [2]}}
    camera = {**state, "observation.image": {"type": "VISUAL", "shape": [3, 96, 96]}}
    action = {"action": {"type": "ACTION", "shape": [2]}}
    assert lerobot_config_dict(config, state, action)["vision_backbone"] == "resnet18"
    assert lerobot_config_dict(config, camera, action)["vision_backbone"] == "lerobot_mg_cnn"
