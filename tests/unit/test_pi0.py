"""pi0 and pi0.5 against LeRobot 0.6.1's own fixtures (tests/fixtures/lerobot_0_6_1/pi0_tiny, pi05_tiny; see
PROVENANCE_vla.md): the config both ways, the state dict (names, order, dtypes, non-persistent buffers), strict
loading and saving, every number LeRobot recorded from the preprocessed batch (losses, intermediates, the action
chunk, gradients), the bfloat16 build, and the full-size parameter counts (on the meta device).

Tolerances (one thread): PROVENANCE_vla.md's 1e-5 for chunks and intermediates; losses within 1e-6 absolute plus
1e-6 relative (values up to 3.6, where one float32 ulp is 2.4e-7). The SigLIP-dependent tensors match LeRobot 0.6.1
run in a fresh process bit for bit; the fixture's stored ones differ from such a run by up to 2e-6 (checked by hand
with LeRobot's own code), well inside 1e-5, but enough to flip bfloat16 roundings: the bfloat16 comparisons use the
spread that implies (see test_bfloat16_build_matches_lerobots)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lerobot_mg.config import register_configs
from lerobot_mg.config.loading import CONF_DIR, to_train_config
from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.pi05 import PI05Config
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.base import SAMPLE_SEED_KEY
from lerobot_mg.policies.pi0.modeling_pi0 import PI0Policy
from lerobot_mg.policies.pi05.modeling_pi05 import PI05Policy
from lerobot_mg.policies.registry import load_pretrained, make_policy
from lerobot_mg.policies.vla import common
from tests import vla_fixtures as vf
from tests.launch_utils import PUSHT_SLICE
from tests.tolerances import FLOAT32_ULPS, assert_close

PI_FIXTURES = ("pi0_tiny", "pi05_tiny")
LOSS_TOLERANCE = {"atol": vf.ATOL_LOSSES, "rtol": 1e-6}
TENSOR_TOLERANCE = {"atol": vf.ATOL_TENSORS, "rtol": 0.0}
FULL_SIZE_PARAMETERS = {"pi0": 4_028_019_472, "pi05": 4_143_404_816}


def _load(name: str, directory: Path, **extra: object) -> PI0Policy:
    copy = vf.loadable_pretrained_copy(name, directory, {"dimension_overrides": vf.pi_dimension_overrides(name)})
    if extra:
        config_path = copy / "config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **extra}, indent=4))
    policy = load_pretrained(copy)
    assert isinstance(policy, PI0Policy)
    return policy


@pytest.fixture(scope="module", params=PI_FIXTURES)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, PI0Policy, dict[str, torch.Tensor]]:
    name = request.param
    return name, _load(name, tmp_path_factory.mktemp(name)), vf.reference(name)


def _close(actual: torch.Tensor, expected: torch.Tensor, key: str, tolerance: dict[str, float]) -> None:
    assert actual.shape == expected.shape, key
    torch.testing.assert_close(actual.float(), expected.float(), msg=key, **tolerance)


# --- config and state dict ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PI_FIXTURES)
def test_config_json_reads_and_writes_as_lerobots(name: str, tmp_path: Path) -> None:
    policy = _load(name, tmp_path)
    assert type(policy) is (PI0Policy if name == "pi0_tiny" else PI05Policy)
    assert policy.config_dict() == vf.config_json(name)
    assert "dimension_overrides" not in policy.config_dict()
    assert policy.config.vlm_dims.width == 64 and policy.config.expert_dims.width == 32


@pytest.mark.parametrize("config_class", [PI0Config, PI05Config])
def test_defaults_are_lerobots(config_class: type[PI0Config]) -> None:
    config = config_class()
    config.validate()
    assert (config.chunk_size, config.n_action_steps, config.max_state_dim, config.max_action_dim) == (50, 50, 32, 32)
    assert config.tokenizer_max_length == (48 if config_class is PI0Config else 200)
    assert config.normalization_mapping["STATE"].value == ("MEAN_STD" if config_class is PI0Config else "QUANTILES")
    assert (config.optimizer_lr, config.optimizer_betas, config.scheduler_decay_steps) == (2.5e-5, [0.9, 0.95], 30000)
    assert config.action_delta_indices == list(range(50))


@pytest.mark.parametrize(("policy_class", "config_class"), [(PI0Policy, PI0Config), (PI05Policy, PI05Config)])
def test_full_size_parameter_count_is_lerobots(policy_class: type[PI0Policy], config_class: type[PI0Config]) -> None:
    features = {"observation.state": {"type": "STATE", "shape": [14]},
                "observation.images.top": {"type": "VISUAL", "shape": [3, 224, 224]}}
    with torch.device("meta"):
        policy = policy_class(config_class(), features, {"action": {"type": "ACTION", "shape": [14]}})
    assert sum(p.numel() for p in policy.parameters()) == FULL_SIZE_PARAMETERS[policy.name]
    assert len(policy.fsdp_unit_groups()) == 18


def test_state_dict_is_lerobots(loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]]) -> None:
    name, policy, _ = loaded
    manifest = vf.manifest(name)
    state_dict = policy.state_dict()
    assert list(state_dict) == [entry["key"] for entry in manifest["keys"]]
    stored = load_file(str(vf.pretrained_model_dir(name) / "model.safetensors"))
    for entry in manifest["keys"]:
        tensor = state_dict[entry["key"]]
        assert (list(tensor.shape), str(tensor.dtype).removeprefix("torch.")) == (entry["shape"], entry["dtype"])
        assert torch.equal(tensor, stored[entry["key"]]), entry["key"]
    _check_non_persistent_buffers(policy, manifest)


def _check_non_persistent_buffers(policy: PI0Policy, manifest: dict) -> None:
    persistent = policy.state_dict()
    buffers = {key: value for key, value in policy.named_buffers() if key not in persistent}
    assert sorted(buffers) == sorted(entry["name"] for entry in manifest["non_persistent_buffers"])
    for entry in manifest["non_persistent_buffers"]:
        buffer = buffers[entry["name"]]
        assert str(buffer.dtype).removeprefix("torch.") == entry["dtype"], entry["name"]
        # Position ids, scales and RoPE's inverse frequencies (a float32 pow LeRobot's CPU computed: its ulps)
        assert_close(buffer.flatten(), torch.tensor(entry["values"], dtype=torch.float64), **FLOAT32_ULPS,
                     msg=entry["name"])


def test_save_writes_what_lerobot_loads(loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]], tmp_path: Path
                                        ) -> None:
    name, policy, _ = loaded
    policy.save_pretrained(tmp_path / "saved")
    theirs = vf.pretrained_model_dir(name) / "model.safetensors"
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as ours_file, \
            safe_open(str(theirs), "pt") as their_file:
        assert list(ours_file.keys()) == list(their_file.keys())
        for key in their_file.keys():
            assert torch.equal(ours_file.get_tensor(key), their_file.get_tensor(key)), key
    assert json.loads((tmp_path / "saved" / "config.json").read_text()) == vf.config_json(name)


def test_loading_is_strict_and_names_the_keys(tmp_path: Path) -> None:
    name = "pi0_tiny"
    copy = vf.loadable_pretrained_copy(name, tmp_path, {"dimension_overrides": vf.pi_dimension_overrides(name)})
    weights = load_file(str(copy / "model.safetensors"))
    dropped = "model.state_proj.bias"
    save_file({k: v for k, v in weights.items() if k != dropped}, str(copy / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"missing keys \\['{dropped}'\\]"):
        load_pretrained(copy)
    save_file({**weights, "model.extra.weight": torch.zeros(1)}, str(copy / "model.safetensors"))
    with pytest.raises(ConfigError, match="unexpected keys \\['model.extra.weight'\\]"):
        load_pretrained(copy)
    # The sizes the weights were saved with are not the config's: a ConfigError, never a random model.
    wrong = vf.loadable_pretrained_copy(name, tmp_path / "wrong", {"dimension_overrides": {
        **vf.pi_dimension_overrides(name), "text": {"vocab_size": 301}}})
    with pytest.raises(ConfigError, match="does not match the policy built from"):
        load_pretrained(wrong)


def test_dimension_overrides_are_checked() -> None:
    with pytest.raises(ConfigError, match="policy.dimension_overrides.gemma_300m.num_heads=4: the expert attends"):
        PI0Config(dimension_overrides={"gemma_300m": {"num_heads": 4}}).validate()
    with pytest.raises(ConfigError, match="policy.dimension_overrides.vision.depth=2: is not a size of vision"):
        PI0Config(dimension_overrides={"vision": {"depth": 2}}).validate()
    with pytest.raises(ConfigError, match="policy.dimension_overrides.gemma_2b.width=0: must be >= 1"):
        PI0Config(dimension_overrides={"gemma_2b": {"width": 0}}).validate()
    with pytest.raises(ConfigError, match="policy.n_action_steps=60: cannot exceed policy.chunk_size=50"):
        PI0Config(n_action_steps=60).validate()


# --- numbers ------------------------------------------------------------------------------------------------------


def test_training_loss_and_intermediates_match(loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]]) -> None:
    name, policy, ref = loaded
    batch = vf.preprocessed_batch(name)
    noise, time = ref["input.noise"], ref["input.time"]
    policy.train()
    images, img_masks = policy.preprocess_images(batch)
    for index, (image, mask) in enumerate(zip(images, img_masks, strict=True)):
        _close(image, ref[f"model.images.{index}"], f"model.images.{index}", TENSOR_TOLERANCE)
        assert torch.equal(mask, ref[f"model.img_masks.{index}"])
    actions = policy.prepare_action(batch)
    assert torch.equal(actions, ref["model.actions_padded"])
    state = policy.prepare_state(batch)
    if "model.state_padded" in ref:
        assert torch.equal(state, ref["model.state_padded"])
    model = policy.model
    tokens, masks = batch["observation.language.tokens"], batch["observation.language.attention_mask"]
    x_t, _ = common.flow_matching_pair(actions, noise, time)
    _close(x_t, ref["train.x_t"], "train.x_t", TENSOR_TOLERANCE)
    with torch.no_grad():
        prefix = model.embed_prefix(images, img_masks, tokens, masks)
        suffix = model.embed_suffix(state, x_t, time)
    for key, ours in zip(("embs", "pad_masks", "att_masks"), prefix, strict=True):
        _close(ours, ref[f"train.prefix_{key}"], f"train.prefix_{key}", TENSOR_TOLERANCE)
    for key, ours in zip(("embs", "pad_masks", "att_masks"), suffix[:3], strict=True):
        _close(ours, ref[f"train.suffix_{key}"], f"train.suffix_{key}", TENSOR_TOLERANCE)
    if "train.adarms_cond" in ref:
        _close(suffix[3], ref["train.adarms_cond"], "train.adarms_cond", TENSOR_TOLERANCE)
    pad = torch.cat([prefix[1], suffix[1]], dim=1)
    assert torch.equal(common.make_att_2d_masks(pad, torch.cat([prefix[2], suffix[2]], dim=1)),
                       ref["train.att_2d_masks"])
    assert torch.equal(common.position_ids_from_pad_masks(pad), ref["train.position_ids"])

    captured: dict[str, object] = {}
    vlm_layer0 = model.paligemma_with_expert.vlm.layers[0]
    hooks = [vlm_layer0.register_forward_hook(lambda m, a, out: captured.setdefault("layer0", out)),
             model.paligemma_with_expert.register_forward_hook(lambda m, a, out: captured.setdefault("pwe", out)),
             model.action_out_proj.register_forward_hook(lambda m, a, out: captured.setdefault("v_t", out))]
    try:
        with torch.no_grad():
            losses = policy.elementwise_losses(batch, noise, time)
    finally:
        for hook in hooks:
            hook.remove()
    layer0, pwe = captured["layer0"], captured["pwe"]
    _close(layer0[0], ref["train.layer0_out.vlm"], "train.layer0_out.vlm", TENSOR_TOLERANCE)
    _close(layer0[1], ref["train.layer0_out.expert"], "train.layer0_out.expert", TENSOR_TOLERANCE)
    _close(pwe[1], ref["train.suffix_out"], "train.suffix_out", TENSOR_TOLERANCE)
    _close(captured["v_t"], ref["train.v_t"], "train.v_t", TENSOR_TOLERANCE)
    # Elementwise squared errors (up to 30) are compared as intermediates; their means as losses.
    _close(losses, ref["train.losses_elementwise"][:, :, : policy.action_dim], "train.losses_elementwise",
           TENSOR_TOLERANCE)
    _close(losses.mean(dim=(0, 1)), ref["train.loss_per_dim"], "train.loss_per_dim", LOSS_TOLERANCE)
    with torch.no_grad():
        loss, _ = policy(batch, noise=noise, time=time)
        per_sample, _ = policy(batch, noise=noise, time=time, reduction="none")
    _close(loss, ref["train.loss"], "train.loss", LOSS_TOLERANCE)
    _close(per_sample, ref["train.per_sample_loss"], "train.per_sample_loss", LOSS_TOLERANCE)


def test_padded_steps_count_in_the_loss_as_in_lerobot(loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]]
                                                      ) -> None:
    name, policy, ref = loaded
    batch = vf.preprocessed_batch(name)
    assert batch["action_is_pad"].any()
    unpadded = {**batch, "action_is_pad": torch.zeros_like(batch["action_is_pad"])}
    with torch.no_grad():
        assert torch.equal(policy(batch, noise=ref["input.noise"], time=ref["input.time"])[0],
                           policy(unpadded, noise=ref["input.noise"], time=ref["input.time"])[0])


def test_gradients_match(loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]]) -> None:
    name, policy, ref = loaded
    policy.train()
    policy.zero_grad(set_to_none=True)
    loss, _ = policy(vf.preprocessed_batch(name), noise=ref["input.noise"], time=ref["input.time"])
    loss.backward()
    parameters = dict(policy.named_parameters())
    grad_keys = [key for key in ref if key.startswith("grad.")]
    assert len(grad_keys) >= 5
    for key in grad_keys:
        _close(parameters[key.removeprefix("grad.")].grad, ref[key], key, TENSOR_TOLERANCE)
    # LeRobot's structure facts: both language heads and the last VLM layer's output side get no gradient, the
    # last VLM layer's q_proj an exactly zero one, every other parameter a gradient.
    without = sorted(name for name, param in parameters.items() if param.grad is None)
    assert without == sorted(policy.unused_parameter_names())
    pwe = "model.paligemma_with_expert."
    assert {f"{pwe}paligemma.lm_head.weight", f"{pwe}gemma_expert.lm_head.weight",
            f"{pwe}paligemma.model.language_model.layers.1.mlp.up_proj.weight",
            f"{pwe}paligemma.model.language_model.norm.weight"} <= set(without)
    assert len(without) == 8  # the two heads, the final norm, o_proj, the norm and 3 MLP weights of the last layer
    assert parameters[f"{pwe}paligemma.model.language_model.layers.1.self_attn.q_proj.weight"].grad.eq(0).all()
    policy.zero_grad(set_to_none=True)


def test_inference_matches(loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]]) -> None:
    name, policy, ref = loaded
    batch = vf.preprocessed_batch(name)
    observation = {key: value for key, value in batch.items() if key.startswith("observation.")}
    policy.eval()
    pwe = policy.model.paligemma_with_expert
    calls: list[tuple] = []
    vlm_outputs: list[tuple] = []
    expert_outputs: list[torch.Tensor] = []
    hooks = [pwe.register_forward_hook(lambda m, args, kwargs, out: calls.append((args, kwargs, out)),
                                       with_kwargs=True),
             pwe.vlm.layers[0].register_forward_hook(lambda m, a, out: vlm_outputs.append(out)),
             pwe.expert.layers[0].register_forward_hook(lambda m, a, out: expert_outputs.append(out))]
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        chunk = policy.predict_action_chunk(observation, noise=ref["input.sample_noise"],
                                            on_step=lambda t, x, v: steps.append((t, v)))
    finally:
        for hook in hooks:
            hook.remove()
    _close(chunk, ref["eval.action_chunk"], "eval.action_chunk", TENSOR_TOLERANCE)
    (prefix_args, _, prefix_out), (denoise_args, denoise_kwargs, _) = calls[0], calls[1]
    assert len(calls) == 1 + policy.config.num_inference_steps
    assert torch.equal(prefix_args[2][:, 0] == 0, ref["eval.prefix_att_2d_masks"])
    assert torch.equal(prefix_args[3], ref["eval.prefix_position_ids"])
    _close(vlm_outputs[0][0], ref["eval.prefix_layer0_out"], "eval.prefix_layer0_out", TENSOR_TOLERANCE)
    _close(vlm_outputs[0][2].key, ref["eval.prefix_kv.layer0.keys"], "eval.prefix_kv.layer0.keys", TENSOR_TOLERANCE)
    _close(vlm_outputs[0][2].value, ref["eval.prefix_kv.layer0.values"], "eval.prefix_kv.layer0.values",
           TENSOR_TOLERANCE)
    _close(prefix_out[0], ref["eval.prefix_out"], "eval.prefix_out", TENSOR_TOLERANCE)
    assert torch.equal(denoise_args[2][:, 0] == 0, ref["eval.denoise0.att_2d_masks"])
    assert torch.equal(denoise_args[3], ref["eval.denoise0.position_ids"])
    _close(denoise_args[1], ref["eval.denoise0.suffix_embs"], "eval.denoise0.suffix_embs", TENSOR_TOLERANCE)
    if "eval.denoise0.adarms_cond" in ref:
        _close(denoise_kwargs["expert_cond"], ref["eval.denoise0.adarms_cond"], "eval.denoise0.adarms_cond",
               TENSOR_TOLERANCE)
    assert expert_outputs[0] is None  # the prefix-only pass
    _close(expert_outputs[1], ref["eval.denoise0.expert_layer0_out"], "eval.denoise0.expert_layer0_out",
           TENSOR_TOLERANCE)
    _close(torch.stack([t for t, _ in steps]), ref["eval.timesteps"], "eval.timesteps", TENSOR_TOLERANCE)
    _close(torch.stack([v for _, v in steps]), ref["eval.v_t"], "eval.v_t", TENSOR_TOLERANCE)


def test_bfloat16_build_matches_lerobots(tmp_path: Path) -> None:
    """LeRobot's bfloat16 build: dtypes of every tensor and buffer exactly; numbers within the spread a 2e-6
    change of the float32 image tokens gives after bfloat16 rounding (LeRobot's own fresh-process run differs from
    the stored eval.action_chunk by 4.6e-3 on pi0_tiny and equals ours bit for bit). The bfloat16 build differs
    from the float32 one by up to 0.018 on the chunk and 0.003 on the loss."""
    for name in PI_FIXTURES:
        policy = _load(name, tmp_path / name, dtype="bfloat16")
        ref = vf.reference(name)
        manifest = vf.manifest(name, "bfloat16")
        state_dict = policy.state_dict()
        assert [(k, str(v.dtype).removeprefix("torch.")) for k, v in state_dict.items()] == [
            (entry["key"], entry["dtype"]) for entry in manifest["keys"]]
        _check_non_persistent_buffers(policy, manifest)
        batch = vf.preprocessed_batch(name)
        policy.train()
        with torch.no_grad():
            loss, _ = policy(batch, noise=ref["input.noise"], time=ref["input.time"])
        _close(loss, ref["bf16.train.loss"], f"{name} bf16.train.loss", {"atol": 2e-3, "rtol": 0.0})
        policy.eval()
        chunk = policy.predict_action_chunk(batch, noise=ref["input.sample_noise"])
        _close(chunk, ref["bf16.eval.action_chunk"], f"{name} bf16.eval.action_chunk", {"atol": 1e-2, "rtol": 0.0})
        assert not torch.allclose(chunk, ref["eval.action_chunk"], atol=1e-4), "the bfloat16 build computed in float32"


def test_each_sample_draws_its_own_noise_and_time_from_its_seed(
        loaded: tuple[str, PI0Policy, dict[str, torch.Tensor]]) -> None:
    """A sample trains on the same draws whatever batch it is in (the layout-independence of training)."""
    name, policy, _ = loaded
    batch = {**vf.preprocessed_batch(name), SAMPLE_SEED_KEY: torch.tensor([11, 12])}
    policy.train()
    with torch.no_grad():
        per_sample, _ = policy(batch, reduction="none")
        second = {key: value[1:] for key, value in batch.items()}
        alone, _ = policy(second, reduction="none")
        again, _ = policy(batch, reduction="none")
    torch.testing.assert_close(alone, per_sample[1:], atol=1e-6, rtol=1e-6)
    assert torch.equal(again, per_sample)


# --- the preset and the action queue ------------------------------------------------------------------------------

TINY_OVERRIDES = [f"policy.dimension_overrides.{section}.{size}={value}"
                  for section, sizes in vf.pi_dimension_overrides("pi0_tiny").items() for size, value in sizes.items()]


@pytest.mark.parametrize("option", ["pi0", "pi05"])
def test_the_preset_with_tiny_dimensions_builds_and_trains_on_a_dataset(option: str) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=[f"policy={option}", *TINY_OVERRIDES,
                                                           "policy.image_resolution=[42,42]", "policy.chunk_size=4",
                                                           "policy.n_action_steps=4", "policy.tokenizer_max_length=6"])
    config = to_train_config(composed).policy
    features = json.loads((PUSHT_SLICE / "meta" / "info.json").read_text())["features"]
    policy = make_policy(config, features)
    assert type(policy).name == option and policy.config.vlm_dims.depth == 2
    assert "dimension_overrides" not in policy.config_dict()
    generator = torch.Generator().manual_seed(0)
    batch = {"observation.image": torch.rand(3, 3, 96, 96, generator=generator),
             "observation.state": torch.randn(3, 2, generator=generator),
             "action": torch.randn(3, 4, 2, generator=generator),
             "observation.language.tokens": torch.randint(0, 300, (3, 6), generator=generator),
             "observation.language.attention_mask": torch.ones(3, 6, dtype=torch.bool),
             SAMPLE_SEED_KEY: torch.tensor([1, 2, 3])}
    policy.train()
    loss, _ = policy(batch)
    loss.backward()
    assert torch.isfinite(loss) and policy.model.action_in_proj.weight.grad.abs().sum() > 0
    policy.eval()
    policy.reset()
    observation = {key: value for key, value in batch.items() if key.startswith("observation.")}
    torch.manual_seed(5)
    chunk = policy.predict_action_chunk(observation)
    torch.manual_seed(5)
    queued = [policy.select_action(observation) for _ in range(4)]
    assert chunk.shape == (3, 4, 2)
    torch.testing.assert_close(torch.stack(queued, dim=1), chunk, atol=0, rtol=0)
