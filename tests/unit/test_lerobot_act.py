"""ACT is LeRobot 0.6.1's, number for number: each fixture's policy (tests/fixtures/lerobot_0_6_1, LeRobot's own
config.json fields and weights) loads strictly into ours and gives LeRobot's reference tensors on the stored
normalized batch, on one thread, within the fixture README's tolerances (atol 1e-5 on tensors, 1e-6 on loss
values, relative 1e-6 on the large training loss)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.processors.normalize import load_processors
from tests.lerobot_fixtures import (
    chunk_with_encoder_io,
    config_json,
    fixture_state_dict,
    manifest,
    normalized_camera,
    pretrained_model_dir,
    reference,
)
from tests.tolerances import FLOAT32_ULPS, assert_close

FIXTURES = ["act_state", "act_image"]
CAMERA = "observation.images.top"
TENSOR_ATOL, LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-6, 1e-6


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixture_policy(name: str) -> ACTPolicy:
    """Built from the fixture's config.json (the fields ACTConfig has) and loaded with its weights, strictly."""
    raw = config_json(name)
    known = {field.name for field in fields(ACTConfig)}
    config = ACTConfig(**{key: value for key, value in raw.items() if key in known})
    config.validate()
    policy = ACTPolicy(config, raw["input_features"], raw["output_features"], load_backbone_weights=False)
    policy.load_state_dict(fixture_state_dict(name), strict=True)
    return policy


def normalized_batch(name: str) -> dict[str, torch.Tensor]:
    """What LeRobot's preprocessor handed its policy: the stored ``pre.*`` tensors (and the camera, normalized
    with the preprocessor's ImageNet statistics)."""
    stored = reference(name)
    batch = {key.removeprefix("pre."): value for key, value in stored.items() if key.startswith("pre.")}
    batch["action_is_pad"] = stored["input.action_is_pad"]
    if name == "act_image":
        batch[CAMERA] = normalized_camera(name, CAMERA)
    return batch


def assert_tensor(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=TENSOR_ATOL, rtol=0)


def assert_loss(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=LOSS_ATOL, rtol=LOSS_RTOL)


@pytest.mark.parametrize("name", FIXTURES)
def test_state_dict_is_lerobots(name: str) -> None:
    """Names in LeRobot's order, shapes, dtypes and parameter/buffer kinds of the manifest, and the one
    constructor-computed buffer (the VAE encoder's sinusoid table) equal to LeRobot's value bit for bit."""
    raw = config_json(name)
    known = {field.name for field in fields(ACTConfig)}
    config = ACTConfig(**{key: value for key, value in raw.items() if key in known})
    policy = ACTPolicy(config, raw["input_features"], raw["output_features"], load_backbone_weights=False)
    state_dict = policy.state_dict()
    entries = manifest(name)
    assert list(state_dict) == [entry["key"] for entry in entries]
    parameters = dict(policy.named_parameters())
    for entry in entries:
        tensor = state_dict[entry["key"]]
        assert list(tensor.shape) == entry["shape"] and str(tensor.dtype).removeprefix("torch.") == entry["dtype"]
        assert (entry["key"] in parameters) == (entry["kind"] == "parameter"), entry["key"]
    # The sinusoids our constructor computes against those LeRobot's CPU computed: its sin/cos kernels' ulps
    assert_close(state_dict["model.vae_encoder_pos_enc"], fixture_state_dict(name)["model.vae_encoder_pos_enc"],
                 **FLOAT32_ULPS)


@pytest.mark.parametrize("name", FIXTURES)
def test_eval_mode_matches_lerobot(name: str) -> None:
    """No VAE branch in eval mode: latent zeros, loss = l1 (mean over the non-padded entries); encoder input,
    position embedding and output (hooked), the camera's feature map, and the action chunk."""
    policy, batch, expected = fixture_policy(name).eval(), normalized_batch(name), reference(name)
    loss, logs = policy(batch)
    assert_loss(loss, expected["eval.loss"])
    assert_loss(logs["l1_loss"], expected["eval.l1_loss"])
    assert float(logs["kld_loss"]) == 0.0

    chunk, seen = chunk_with_encoder_io(policy, policy, batch)
    assert_tensor(seen["tokens"], expected["eval.encoder_in_tokens"])
    assert_tensor(seen["pos_embed"], expected["eval.encoder_in_pos_embed"])
    assert_tensor(seen["out"], expected["eval.encoder_out"])
    assert_tensor(chunk, expected["eval.action_chunk"])
    if name == "act_image":
        with torch.no_grad():
            assert_tensor(policy.model.backbone(batch[CAMERA]), expected["eval.backbone_feature_map"])


@pytest.mark.parametrize("name", FIXTURES)
def test_train_mode_matches_lerobot(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training mode with dropout and attention in eval() and the stored latent noise: the VAE posterior, the
    predicted chunk, and l1 + kl_weight * kld."""
    policy, batch, expected = fixture_policy(name).train(), normalized_batch(name), reference(name)
    for module in policy.modules():
        if isinstance(module, (torch.nn.Dropout, torch.nn.MultiheadAttention)):
            module.eval()
    eps = expected["input.train_latent_eps"]
    monkeypatch.setattr(torch, "randn_like", lambda like, *args, **kwargs: eps.clone())
    with torch.no_grad():
        actions_hat, (mu, log_sigma_x2) = policy.model(batch)
        loss, logs = policy(batch)
    assert_tensor(mu, expected["train.vae_mu"])
    assert_tensor(log_sigma_x2, expected["train.vae_log_sigma_x2"])
    assert_tensor(actions_hat, expected["train.actions_hat"])
    assert_loss(loss, expected["train.loss"])
    assert_loss(logs["l1_loss"], expected["train.l1_loss"])
    assert_loss(logs["kld_loss"], expected["train.kld_loss"])


def test_l1_is_the_mean_over_non_padded_entries() -> None:
    """The fixture's check: act_state's eval L1 is 1.02720 with LeRobot's mask, 1.08257 over every entry."""
    policy, batch = fixture_policy("act_state").eval(), normalized_batch("act_state")
    assert batch["action_is_pad"].any()
    assert float(policy(batch)[1]["l1_loss"]) == pytest.approx(1.02720, abs=1e-5)
    unpadded = dict(batch, action_is_pad=torch.zeros_like(batch["action_is_pad"]))
    assert float(policy(unpadded)[1]["l1_loss"]) == pytest.approx(1.08257, abs=1e-5)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_raw_batch_through_our_processors_and_policy_gives_lerobots_actions(name: str) -> None:
    """End to end: the raw batch (camera uint8 / 255, as lerobot_train.py hands it over) through our preprocessor
    read from the fixture's files, our policy, and our postprocessor: LeRobot's loss and unnormalized chunk."""
    policy, expected = fixture_policy(name).eval(), reference(name)
    preprocessor, postprocessor = load_processors(pretrained_model_dir(name))
    raw = {key.removeprefix("input."): value for key, value in expected.items()
           if key.startswith("input.") and key != "input.train_latent_eps"}
    if name == "act_image":
        raw[CAMERA] = raw.pop(f"{CAMERA}.uint8").float() / 255
    batch = preprocessor(raw)
    assert_loss(policy(batch)[0], expected["eval.loss"])
    observation = {key: value for key, value in batch.items() if not key.startswith("action")}
    actions = postprocessor({"action": policy.predict_action_chunk(observation)})["action"]
    assert_tensor(actions, expected["eval.action_chunk_unnormalized"])


def test_a_checkpoint_never_loads_backbone_weights(tmp_path: Path) -> None:
    """LeRobot's default pretrained_backbone_weights is torchvision's weight name; a checkpoint that keeps it
    loads here without torchvision and without a download: its model.safetensors holds the backbone."""
    directory = tmp_path / "pretrained_model"
    shutil.copytree(pretrained_model_dir("act_image"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["pretrained_backbone_weights"] = "ResNet18_Weights.IMAGENET1K_V1"
    (directory / "config.json").write_text(json.dumps(config, indent=4))
    save_file(fixture_state_dict("act_image"), str(directory / "model.safetensors"), metadata={"format": "pt"})
    policy = ACTPolicy.from_pretrained(directory)
    assert_loss(policy(normalized_batch("act_image"))[0], reference("act_image")["eval.loss"])
