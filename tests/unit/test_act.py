"""ACT policy: shapes, loss masking, VAE on/off, action queue, temporal ensembling, backbones and their weights,
save/load, config validation, features. (LeRobot's numbers: test_lerobot_act.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from lerobot_mg.config.schema import POLICY_CONFIGS
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies import (
    features_from_dataset,
    get_policy_class,
    load_pretrained,
    make_policy,
)
from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.policies.act.modeling_act import ACTDropout, ACTEncoder, attention
from lerobot_mg.policies.diffusion import DiffusionPolicy
from lerobot_mg.policies.pi0.modeling_pi0 import PI0Policy
from lerobot_mg.policies.pi05.modeling_pi05 import PI05Policy
from lerobot_mg.policies.smolvla.modeling_smolvla import SmolVLAPolicy
from lerobot_mg.policies.vision import ResNet18FeatureMap
from tests.launch_utils import PUSHT_SLICE
from tests.tolerances import FLOAT32_ULPS, assert_close

PUSHT_META = PUSHT_SLICE / "meta"

STATE_DIM, ENV_DIM, ACTION_DIM, CHUNK, BATCH = 6, 3, 4, 5, 3
STATE_ONLY_INPUTS = {
    "observation.state": {"type": "STATE", "shape": [STATE_DIM]},
    "observation.environment_state": {"type": "ENV", "shape": [ENV_DIM]},
}
IMAGE_INPUTS = {
    "observation.state": {"type": "STATE", "shape": [STATE_DIM]},
    "observation.images.top": {"type": "VISUAL", "shape": [3, 16, 16]},
}
OUTPUTS = {"action": {"type": "ACTION", "shape": [ACTION_DIM]}}


def tiny_config(**overrides: object) -> ACTConfig:
    config = ACTConfig(
        chunk_size=CHUNK,
        n_action_steps=3,
        dim_model=32,
        n_heads=4,
        dim_feedforward=64,
        n_encoder_layers=2,
        n_decoder_layers=1,
        latent_dim=8,
        n_vae_encoder_layers=1,
        vision_backbone="lerobot_mg_cnn",
        vision_channels=[8, 16],
    )
    return replace(config, **overrides)


def make_batch(input_features: dict, seed: int = 0, num_padded: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch = {
        key: torch.randn(BATCH, *spec["shape"], generator=generator) for key, spec in input_features.items()
    }
    batch["action"] = torch.randn(BATCH, CHUNK, ACTION_DIM, generator=generator)
    action_is_pad = torch.zeros(BATCH, CHUNK, dtype=torch.bool)
    if num_padded:
        action_is_pad[:, CHUNK - num_padded :] = True
    batch["action_is_pad"] = action_is_pad
    return batch


def seeded_loss(
    policy: ACTPolicy, batch: dict[str, torch.Tensor], seed: int = 1
) -> tuple[torch.Tensor, dict]:
    # Dropout and the VAE sample draw from the global RNG: reseed so two calls see the same noise.
    torch.manual_seed(seed)
    loss, logs = policy(batch)
    return loss, {key: float(value) for key, value in logs.items()}  # device tensors, read here


@pytest.mark.parametrize("input_features", [STATE_ONLY_INPUTS, IMAGE_INPUTS], ids=["state_only", "image"])
def test_forward_backward_reaches_every_parameter(input_features: dict) -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(), input_features, OUTPUTS)
    policy.train()
    loss, logs = seeded_loss(policy, make_batch(input_features))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(logs) == {"l1_loss", "kld_loss"}
    assert logs["kld_loss"] > 0
    assert loss.item() == pytest.approx(logs["l1_loss"] + 10.0 * logs["kld_loss"], rel=1e-5)
    loss.backward()
    # DDP without find_unused_parameters needs every parameter to take part in the training loss.
    no_grad = [name for name, param in policy.named_parameters() if param.grad is None]
    assert no_grad == []
    policy.eval()
    chunk = policy.predict_action_chunk(make_batch(input_features))
    assert chunk.shape == (BATCH, CHUNK, ACTION_DIM)


def test_image_tokens_depend_on_the_image() -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS).eval()
    batch = make_batch(IMAGE_INPUTS)
    other = dict(batch, **{"observation.images.top": torch.zeros_like(batch["observation.images.top"])})
    assert not torch.allclose(policy.predict_action_chunk(batch), policy.predict_action_chunk(other))


def test_loss_ignores_padded_positions() -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS).train()
    batch = make_batch(STATE_ONLY_INPUTS, num_padded=2)
    changed_pad = dict(batch, action=batch["action"].clone())
    changed_pad["action"][:, CHUNK - 2 :] = 1000.0
    loss, logs = seeded_loss(policy, batch)
    loss_changed_pad, logs_changed_pad = seeded_loss(policy, changed_pad)
    # The VAE masks padded keys too, so even its latent (and the KL term) is unchanged.
    assert loss_changed_pad.item() == pytest.approx(loss.item(), abs=1e-6)
    assert logs_changed_pad["kld_loss"] == pytest.approx(logs["kld_loss"], abs=1e-6)

    changed_valid = dict(batch, action=batch["action"].clone())
    changed_valid["action"][:, 0] += 1.0
    loss_changed_valid, _ = seeded_loss(policy, changed_valid)
    assert abs(loss_changed_valid.item() - loss.item()) > 1e-3


def test_l1_is_the_mean_over_valid_entries_or_per_sample() -> None:
    """valid_entries (LeRobot's): the padded entries leave the denominator. per_sample: they count as zero error,
    every sample weighs the same, so the mean of per-sample (per-rank) losses is the whole batch's loss."""
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(use_vae=False, dropout=0.0), STATE_ONLY_INPUTS, OUTPUTS).train()
    batch = make_batch(STATE_ONLY_INPUTS, num_padded=2)
    with torch.no_grad():
        prediction = policy.model(batch)[0]
        error = (prediction - batch["action"]).abs()
        valid = error[:, : CHUNK - 2]
        assert float(policy(batch)[1]["l1_loss"]) == pytest.approx(valid.mean().item(), rel=1e-5)
        policy.config.l1_reduction = "per_sample"
        logs = seeded_loss(policy, batch)[1]
        per_sample = [float(policy({k: v[i : i + 1] for k, v in batch.items()})[1]["l1_loss"]) for i in range(BATCH)]
    error[:, CHUNK - 2 :] = 0.0
    assert logs["l1_loss"] == pytest.approx(error.mean().item(), rel=1e-5)  # the same 60 fp32 terms, maybe summed in another order
    assert logs["l1_loss"] == pytest.approx(sum(per_sample) / BATCH, rel=1e-5)


def test_a_fully_padded_batch_has_zero_l1_not_nan() -> None:
    policy = ACTPolicy(tiny_config(use_vae=False), STATE_ONLY_INPUTS, OUTPUTS).eval()
    batch = make_batch(STATE_ONLY_INPUTS, num_padded=CHUNK)
    assert float(policy(batch)[0].detach()) == 0.0


def test_vae_off_has_no_kl_and_no_vae_modules() -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(use_vae=False), STATE_ONLY_INPUTS, OUTPUTS).train()
    assert not any(name.startswith("model.vae") for name, _ in policy.named_parameters())
    loss, logs = seeded_loss(policy, make_batch(STATE_ONLY_INPUTS))
    assert logs["kld_loss"] == 0.0
    assert loss.item() == pytest.approx(logs["l1_loss"], rel=1e-6)


def test_vae_latent_is_zero_at_inference() -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(use_vae=True), STATE_ONLY_INPUTS, OUTPUTS).eval()
    batch = make_batch(STATE_ONLY_INPUTS)
    without_action = {key: value for key, value in batch.items() if not key.startswith("action")}
    torch.testing.assert_close(
        policy.predict_action_chunk(batch), policy.predict_action_chunk(without_action)
    )
    _, logs = policy(batch)
    assert logs["kld_loss"] == 0.0


def test_select_action_consumes_a_queue_of_n_action_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(n_action_steps=3), STATE_ONLY_INPUTS, OUTPUTS).eval()
    chunks = [
        torch.arange(BATCH * CHUNK * ACTION_DIM, dtype=torch.float32).reshape(BATCH, CHUNK, ACTION_DIM)
        + 1000 * i
        for i in range(3)
    ]
    calls: list[int] = []

    def fake_predict(batch: dict) -> torch.Tensor:
        calls.append(1)
        return chunks[len(calls) - 1]

    monkeypatch.setattr(policy, "predict_action_chunk", fake_predict)
    observation = make_batch(STATE_ONLY_INPUTS)
    actions = [policy.select_action(observation) for _ in range(4)]
    assert len(calls) == 2
    for step in range(3):
        torch.testing.assert_close(actions[step], chunks[0][:, step])
    torch.testing.assert_close(actions[3], chunks[1][:, 0])
    assert actions[0].shape == (BATCH, ACTION_DIM)

    policy.reset()
    torch.testing.assert_close(policy.select_action(observation), chunks[2][:, 0])
    assert len(calls) == 3


def test_select_action_matches_predicted_chunk() -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(n_action_steps=2), STATE_ONLY_INPUTS, OUTPUTS).eval()
    observation = make_batch(STATE_ONLY_INPUTS)
    chunk = policy.predict_action_chunk(observation)
    torch.testing.assert_close(policy.select_action(observation), chunk[:, 0])
    torch.testing.assert_close(policy.select_action(observation), chunk[:, 1])


@pytest.mark.parametrize("input_features", [STATE_ONLY_INPUTS, IMAGE_INPUTS], ids=["state_only", "image"])
def test_save_pretrained_round_trip(tmp_path: Path, input_features: dict) -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(), input_features, OUTPUTS)
    policy.save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["type"] == "act"
    assert config["chunk_size"] == CHUNK and "vision_channels" not in config  # lerobot_mg's own: train_config.json
    assert config["input_features"] == input_features and config["output_features"] == OUTPUTS
    # As a run's pretrained_model/ holds it: the run's own policy section (config.json may name LeRobot's backbone
    # for a policy that builds none).
    (tmp_path / "train_config.json").write_text(json.dumps({"policy": {
        "vision_channels": [8, 16], "vision_backbone": str(policy.config.vision_backbone)}}))

    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded, ACTPolicy) and not loaded.training
    assert loaded.config == policy.config
    for key, tensor in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    policy.eval()
    batch = make_batch(input_features)
    assert torch.equal(loaded.predict_action_chunk(batch), policy.predict_action_chunk(batch))


def test_save_pretrained_accepts_shared_storage_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(use_vae=False), STATE_ONLY_INPUTS, OUTPUTS)
    state_dict = policy.state_dict()
    # A gathered FSDP state dict may hand out views of one flat buffer; safetensors refuses shared storage.
    flat = torch.cat([tensor.flatten() for tensor in state_dict.values()])
    views, offset = {}, 0
    for key, tensor in state_dict.items():
        views[key] = flat[offset : offset + tensor.numel()].view_as(tensor)
        offset += tensor.numel()
    policy.save_pretrained(tmp_path, state_dict=views)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved.keys() == state_dict.keys()
    assert all(torch.equal(saved[key], state_dict[key]) for key in state_dict)


def test_from_pretrained_without_weights_points_to_dcp_conversion(tmp_path: Path) -> None:
    policy = ACTPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS)
    policy.write_config(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["config.json"]
    with pytest.raises(ConfigError, match="lerobot-mg-convert-dcp"):
        ACTPolicy.from_pretrained(tmp_path)


def test_same_seed_gives_identical_model_and_loss() -> None:
    losses = []
    for _ in range(2):
        torch.manual_seed(123)
        policy = ACTPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS).train()
        losses.append(seeded_loss(policy, make_batch(IMAGE_INPUTS))[0].item())
    assert losses[0] == losses[1]


def test_parameter_count_of_the_small_state_only_preset() -> None:
    # dim_model=256, 4 encoder / 1 decoder layers, feed-forward 1024, no VAE, 14-d state, 3-d env, 14-d
    # action, chunk 50: the 4.2M-parameter state-only reference ACT. (Feed-forward 3200 gives 9.8M.)
    config = ACTConfig(
        chunk_size=50, n_action_steps=50, dim_model=256, n_heads=8, dim_feedforward=1024, use_vae=False
    )
    inputs = {
        "observation.state": {"type": "STATE", "shape": [14]},
        "observation.environment_state": {"type": "ENV", "shape": [3]},
    }
    policy = ACTPolicy(config, inputs, {"action": {"type": "ACTION", "shape": [14]}})
    assert sum(param.numel() for param in policy.parameters()) == 4_243_470


def test_fsdp_wrap_units_exist_in_the_model() -> None:
    policy = ACTPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS)
    class_names = {type(module).__name__ for module in policy.modules()}
    assert set(ACTPolicy._fsdp_wrap_modules) == {"ACTEncoderLayer", "ACTDecoderLayer"}
    assert set(ACTPolicy._fsdp_wrap_modules) <= class_names
    # Tied weights cannot be split across FSDP units: ACT must have none.
    all_params = [param for _, param in policy.named_parameters(remove_duplicate=False)]
    assert len({id(param) for param in all_params}) == len(all_params)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_action_steps": 6}, r"policy\.n_action_steps=6: exceeds policy\.chunk_size=5.*\. Fix: policy\.n_action_steps=5$"),
        ({"dim_model": 30}, r"policy\.dim_model=30: is not divisible by policy\.n_heads=4.*\. Fix: policy\.n_heads=3$"),
        ({"feedforward_activation": "swish"}, r"policy\.feedforward_activation='swish': must be one of relu, gelu\. Fix: policy\.feedforward_activation=relu$"),
        ({"dropout": 1.5}, r"policy\.dropout=1\.5: must be in \[0, 1\)\. Fix: policy\.dropout=0\.1$"),
        ({"chunk_size": 0}, r"policy\.chunk_size=0: must be >= 1\. Fix: policy\.chunk_size=1$"),
        ({"vision_channels": []}, r"policy\.vision_channels=\[\]: .*\. Fix: policy\.vision_channels=\[32,64,128,256\]$"),
        ({"normalization_mapping": {"STATE": "ZSCORE"}}, r"policy\.normalization_mapping\.STATE='ZSCORE': must be one of MEAN_STD, MIN_MAX, QUANTILES, QUANTILE10, IDENTITY\. Fix: "),
        ({"normalization_mapping": {"DEPTH": "MEAN_STD"}}, r"policy\.normalization_mapping\.DEPTH='MEAN_STD': 'DEPTH' is not a feature type .*\. Fix: ~policy\.normalization_mapping\.DEPTH$"),
        ({"n_obs_steps": 2}, r"policy\.n_obs_steps=2: must be 1: ACT reads the current frame only .*\. Fix: policy\.n_obs_steps=1$"),
        ({"vision_backbone": "resnet50"}, r"policy\.vision_backbone='resnet50': must be one of resnet18, lerobot_mg_cnn\. Fix: "),
        ({"replace_final_stride_with_dilation": 2}, r"policy\.replace_final_stride_with_dilation=2: must be false or true \(0 or 1\)\. Fix: "),
        ({"temporal_ensemble_coeff": 0.01}, r"policy\.n_action_steps=3: must be 1 with policy\.temporal_ensemble_coeff=0\.01 .*\. Fix: policy\.n_action_steps=1, "),
        ({"pretrained_backbone_weights": "ResNet18_Weights.IMAGENET1K_V1"}, r"policy\.pretrained_backbone_weights='ResNet18_Weights\.IMAGENET1K_V1': are ResNet18 weights, but policy\.vision_backbone=lerobot_mg_cnn .*\. Fix: "),
        ({"observation_keys": ["action"]}, r"policy\.observation_keys=\['action'\]: .*\. Fix: policy\.observation_keys=\[observation\.state\]"),
    ],
)
def test_config_validation_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides).validate()


def test_default_config_is_valid_and_a_structured_hydra_schema() -> None:
    ACTConfig().validate()
    schema = OmegaConf.structured(ACTConfig)
    schema.chunk_size = 20
    with pytest.raises(Exception, match="chunk_size"):
        schema.chunk_size = "twenty"
    assert OmegaConf.to_object(schema) == ACTConfig(chunk_size=20)


def test_registry() -> None:
    assert {name: get_policy_class(name) for name in POLICY_CONFIGS} == {
        "act": ACTPolicy, "diffusion": DiffusionPolicy, "pi0": PI0Policy, "pi05": PI05Policy, "smolvla": SmolVLAPolicy}
    assert all(get_policy_class(name).config_class is config for name, config in POLICY_CONFIGS.items())
    assert get_policy_class("act") is ACTPolicy
    with pytest.raises(
        ValueError, match=r"policy\.type='vqbet': is not a known policy\. Fix: policy=<one of act, diffusion, pi0, pi05, smolvla>$"
    ):
        get_policy_class("vqbet")


def test_make_policy_from_hydra_config_and_dataset_features() -> None:
    info = json.loads((PUSHT_META / "info.json").read_text())
    cfg = OmegaConf.structured(tiny_config(chunk_size=5, n_action_steps=5))
    policy = make_policy(cfg, info["features"])
    assert isinstance(policy, ACTPolicy)
    assert policy.input_features == {
        "observation.image": {"type": "VISUAL", "shape": [3, 96, 96]},
        "observation.state": {"type": "STATE", "shape": [2]},
    }
    assert policy.output_features == {"action": {"type": "ACTION", "shape": [2]}}
    with pytest.raises(ConfigError, match="n_action_steps=6: exceeds"):
        make_policy(tiny_config(n_action_steps=6), info["features"])


def test_features_from_dataset_types_and_selection() -> None:
    dataset_features = {
        "observation.images.top": {
            "dtype": "video",
            "shape": [48, 64, 3],
            "names": ["height", "width", "channels"],
        },
        "observation.images.legacy": {
            "dtype": "image",
            "shape": [3, 48, 64],
            "names": ["channels", "height", "width"],
        },
        "observation.state": {"dtype": "float32", "shape": [14]},
        "observation.environment_state": {"dtype": "float32", "shape": [3]},
        "action": {"dtype": "float32", "shape": [14]},
        "timestamp": {"dtype": "float32", "shape": [1]},
    }
    inputs, outputs = features_from_dataset(dataset_features, None)
    assert inputs == {
        "observation.images.top": {"type": "VISUAL", "shape": [3, 48, 64]},
        "observation.images.legacy": {"type": "VISUAL", "shape": [3, 48, 64]},
        "observation.state": {"type": "STATE", "shape": [14]},
        "observation.environment_state": {"type": "ENV", "shape": [3]},
    }
    assert outputs == {"action": {"type": "ACTION", "shape": [14]}}
    inputs, _ = features_from_dataset(dataset_features, ["observation.state"])
    assert list(inputs) == ["observation.state"]
    with pytest.raises(ConfigError, match=r"observation_keys=\['observation.wrist'\]: the dataset has no feature"):
        features_from_dataset(dataset_features, ["observation.wrist"])


def test_from_pretrained_rejects_weights_of_another_shape(tmp_path: Path) -> None:
    ACTPolicy(tiny_config(), STATE_ONLY_INPUTS, OUTPUTS).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["chunk_size"] = config["n_action_steps"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: does not match the policy built from .*decoder_pos_embed.*\. Fix: "
    ):
        load_pretrained(tmp_path)


# --- LeRobot's ACT: defaults, features, backbones, temporal ensembling ------------------------------------------


def test_defaults_are_lerobots_but_never_download() -> None:
    config = ACTConfig()
    assert config.vision_backbone == "resnet18" and config.pretrained_backbone_weights is None
    # No ENV entry: observation.environment_state passes through unnormalized, as in LeRobot.
    assert dict(config.normalization_mapping) == {"VISUAL": "MEAN_STD", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    assert (config.chunk_size, config.n_action_steps, config.dim_model, config.latent_dim) == (100, 100, 512, 32)
    assert {"vision_channels", "l1_reduction"} <= ACTConfig.lerobot_mg_only_fields


@pytest.mark.parametrize("value", [0, 1, False, True])
def test_dilation_flag_takes_lerobots_int_or_bool(value: object) -> None:
    config = tiny_config(replace_final_stride_with_dilation=value)
    config.validate()
    assert OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ACTConfig), {"replace_final_stride_with_dilation": value})).replace_final_stride_with_dilation is bool(value)


def test_resnet18_backbone_has_torchvisions_names_and_cannot_dilate() -> None:
    policy = ACTPolicy(tiny_config(vision_backbone="resnet18"), IMAGE_INPUTS, OUTPUTS)
    keys = [key for key in policy.state_dict() if key.startswith("model.backbone.")]
    assert keys[:5] == ["model.backbone.conv1.weight", "model.backbone.bn1.weight", "model.backbone.bn1.bias",
                        "model.backbone.bn1.running_mean", "model.backbone.bn1.running_var"]
    # Frozen batch norm: its four tensors are buffers; only the convolutions train.
    assert not any(".bn" in name or "downsample.1" in name for name, _ in policy.named_parameters())
    with pytest.raises(ConfigError, match=r"replace_final_stride_with_dilation=True: ResNet18's basic blocks "
                                          r"cannot dilate .*\. Fix: policy\.replace_final_stride_with_dilation=false$"):
        ACTPolicy(tiny_config(vision_backbone="resnet18", replace_final_stride_with_dilation=True), IMAGE_INPUTS,
                  OUTPUTS)


def test_pretrained_backbone_weights_from_a_local_file_not_for_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(3)
    imagenet = ResNet18FeatureMap().state_dict()
    weights = tmp_path / "resnet18.safetensors"
    save_file({**imagenet, "fc.weight": torch.zeros(1000, 512), "fc.bias": torch.zeros(1000)}, str(weights))
    config = tiny_config(vision_backbone="resnet18", pretrained_backbone_weights=str(weights))
    torch.manual_seed(0)
    loaded = ACTPolicy(config, IMAGE_INPUTS, OUTPUTS).model.backbone.state_dict()
    assert all(torch.equal(loaded[key], imagenet[key]) for key in imagenet)
    torch.manual_seed(0)
    from_checkpoint = ACTPolicy(config, IMAGE_INPUTS, OUTPUTS, load_backbone_weights=False).model.backbone
    assert not torch.equal(from_checkpoint.conv1.weight, imagenet["conv1.weight"])


def test_pretrained_backbone_weights_that_are_neither_a_file_nor_a_loadable_name() -> None:
    with pytest.raises(ConfigError, match=r"pretrained_backbone_weights='/no/such\.pth': is neither a file nor "
                                          r"torchvision's name .*\. Fix: "):
        ACTPolicy(tiny_config(vision_backbone="resnet18", pretrained_backbone_weights="/no/such.pth"),
                  IMAGE_INPUTS, OUTPUTS)
    try:
        import torchvision  # noqa: F401  (optional: where it imports, the name would download)
    except Exception:
        with pytest.raises(ConfigError, match=r"is a torchvision weight name, and torchvision cannot be imported"):
            ACTPolicy(tiny_config(vision_backbone="resnet18", pretrained_backbone_weights="ResNet18_Weights.IMAGENET1K_V1"),
                      IMAGE_INPUTS, OUTPUTS)


def test_cameras_of_one_size_share_one_backbone_call() -> None:
    inputs = {**IMAGE_INPUTS, "observation.images.wrist": {"type": "VISUAL", "shape": [3, 16, 16]}}
    torch.manual_seed(0)
    policy = ACTPolicy(tiny_config(), inputs, OUTPUTS).eval()
    batch = make_batch(inputs)
    calls: list[int] = []
    handle = policy.model.backbone.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    chunk = policy.predict_action_chunk(batch)
    handle.remove()
    assert calls == [2 * BATCH]
    # The same tokens as one call per camera (LeRobot's loop).
    tokens = [policy.model.encoder_img_feat_input_proj(policy.model.backbone(batch[key])) for key in
              ("observation.images.top", "observation.images.wrist")]
    seen: dict[str, torch.Tensor] = {}
    handle = policy.model.encoder.register_forward_hook(lambda module, args, out: seen.update(tokens=args[0]))
    torch.testing.assert_close(policy.predict_action_chunk(batch), chunk)
    handle.remove()
    per_camera = torch.cat([t.flatten(2).permute(2, 0, 1) for t in tokens])
    torch.testing.assert_close(seen["tokens"][2:], per_camera.detach())


def test_a_state_feature_other_than_lerobots_two_is_refused() -> None:
    inputs = {**STATE_ONLY_INPUTS, "observation.velocity": {"type": "STATE", "shape": [2]}}
    with pytest.raises(ConfigError, match=r"cannot be an input\. Fix: policy\.observation_keys=\[observation\.state,"
                                          r"observation\.environment_state\]$"):
        ACTPolicy(tiny_config(), inputs, OUTPUTS)


def test_temporal_ensembling_weights_every_prediction_of_a_step() -> None:
    coeff = 0.5
    policy = ACTPolicy(tiny_config(n_action_steps=1, temporal_ensemble_coeff=coeff), STATE_ONLY_INPUTS,
                       OUTPUTS).eval()
    chunks = [torch.randn(BATCH, CHUNK, ACTION_DIM) for _ in range(4)]
    predictions = iter(chunks)
    policy.predict_action_chunk = lambda batch: next(predictions)  # type: ignore[method-assign]
    observation = make_batch(STATE_ONLY_INPUTS)
    actions = [policy.select_action(observation) for _ in range(4)]
    for step, action in enumerate(actions):
        # Step t's action was predicted by chunk k at position t - k; the oldest prediction weighs most.
        weights = torch.exp(-coeff * torch.arange(step + 1.0))
        expected = sum(w * chunks[k][:, step - k] for k, w in enumerate(weights)) / weights.sum()
        torch.testing.assert_close(action, expected)
    policy.reset()
    policy.predict_action_chunk = lambda batch: chunks[0]  # type: ignore[method-assign]
    torch.testing.assert_close(policy.select_action(observation), chunks[0][:, 0])


def test_attention_is_torchs_multihead_attention() -> None:
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(16, 4, dropout=0.1).eval()
    query, key = torch.randn(5, 3, 16), torch.randn(7, 3, 16)
    value = torch.randn(7, 3, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    # The same operations as torch's, but torch's path is its own (it may fuse or pick other kernels on another
    # CPU or release): equal up to float32 ulps, the LeRobot fixtures check the numbers themselves
    assert_close(attention(module, query, key, value, pad), module(query, key, value, key_padding_mask=pad)[0],
                 **FLOAT32_ULPS)
    assert_close(attention(module, query, key, value), module(query, key, value)[0], **FLOAT32_ULPS)


def test_the_vae_encoders_cls_only_last_layer_equals_the_full_stack() -> None:
    torch.manual_seed(0)
    config = tiny_config(n_vae_encoder_layers=2, dropout=0.0)
    encoder = ACTEncoder(config, is_vae_encoder=True).eval()
    tokens, pos = torch.randn(9, 3, 32), torch.randn(9, 1, 32)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[0, 6:] = True
    torch.testing.assert_close(encoder(tokens, pos, pad, first_token_only=True), encoder(tokens, pos, pad)[:1])


def test_dropout_keeps_1_minus_p_and_rescales() -> None:
    torch.manual_seed(0)
    dropout = ACTDropout(0.25).train()
    out = dropout(torch.ones(200_000))
    assert torch.equal(out.unique(), torch.tensor([0.0, 4 / 3]))
    assert (out > 0).float().mean().item() == pytest.approx(0.75, abs=0.005)
    assert torch.equal(dropout.eval()(out), out)


def test_a_meta_device_build_puts_every_tensor_on_meta() -> None:
    # The start-up checks build the policy on the meta device: no memory, no tensor left on the CPU.
    with torch.device("meta"):
        policy = ACTPolicy(tiny_config(vision_backbone="resnet18"), IMAGE_INPUTS, OUTPUTS)
    assert {tensor.device.type for tensor in policy.state_dict().values()} == {"meta"}
