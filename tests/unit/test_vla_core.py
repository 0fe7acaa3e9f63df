"""The VLA core (lerobot_mg.policies.vla): the shared flow-matching numerics, and the joint layer protocol FSDP2
relies on (each VLM layer's forward runs its expert layer's forward inside it, in every pass, and an absent stream
never touches its layer's weights), on the tiny pi0 and pi0.5 of the fixtures."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from lerobot_mg.distributed.wrap import declared_checkpoint_blocks
from lerobot_mg.policies.base import checkpoint_activations
from lerobot_mg.policies.pi0.modeling_pi0 import PI0Policy
from lerobot_mg.policies.registry import load_pretrained
from lerobot_mg.policies.vla import common
from lerobot_mg.policies.vla.gemma import ExpertDecoderLayer, VLMDecoderLayer
from lerobot_mg.policies.vla.paligemma import SIGLIP_LAYER_CLASS
from tests import vla_fixtures as vf
from tests.launch_utils import PYTHON, REPO, clean_env, spawn_ranks
from tests.tolerances import FLOAT32_ULPS, assert_close

PI_FIXTURES = ("pi0_tiny", "pi05_tiny")


# --- common.py ---------------------------------------------------------------------------------------------------


def test_time_embedding_is_sines_then_cosines_of_geometric_periods() -> None:
    time = torch.tensor([0.0, 0.25, 1.0])
    embedding = common.sinusoidal_time_embedding(time, 8, min_period=4e-3, max_period=4.0)
    periods = [4e-3 * (4.0 / 4e-3) ** (i / 3) for i in range(4)]
    expected = torch.tensor([[f(2 * math.pi * t / p) for f in (math.sin, math.cos) for p in periods]
                             for t in time.tolist()], dtype=torch.float64)
    assert embedding.dtype == torch.float64
    torch.testing.assert_close(embedding, expected)
    with pytest.raises(ValueError, match="even"):
        common.sinusoidal_time_embedding(time, 7, 4e-3, 4.0)


def test_att_2d_masks_give_prefix_lm_blocks_and_drop_padding() -> None:
    pad = torch.tensor([[True, True, False, True, True, True]])
    att = torch.tensor([[0, 0, 0, 1, 1, 0]])
    mask = common.make_att_2d_masks(pad, att)[0]
    # tokens 0-2: the prefix (full attention among the valid ones); token 3 a block; tokens 4-5 one causal block.
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 1],
        [1, 1, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    additive = common.attention_masks_4d(mask[None])
    assert additive.shape == (1, 1, 6, 6)
    assert torch.equal(additive[0, 0] == 0, expected) and additive.min() == torch.tensor(common.ATTENTION_MASK_VALUE)
    assert common.position_ids_from_pad_masks(pad).tolist() == [[0, 1, 1, 2, 3, 4]]


def test_pad_vector_pads_with_zeros_and_keeps_wider_vectors() -> None:
    vector = torch.ones(2, 3)
    assert common.pad_vector(vector, 5).tolist() == [[1, 1, 1, 0, 0]] * 2
    assert common.pad_vector(vector, 2) is vector


def test_resize_with_pad_keeps_the_aspect_and_centres_the_image() -> None:
    image = torch.full((1, 8, 16, 3), 0.5)  # (B, H, W, C): twice as wide as high
    out = common.resize_with_pad_centered(image, 8, 8)
    assert out.shape == (1, 8, 8, 3)
    assert out[0, 2:6].eq(0.5).all() and out[0, [0, 1, 6, 7]].eq(0).all()
    channels_first = common.resize_with_pad_centered(image.permute(0, 3, 1, 2), 8, 8)
    assert_close(channels_first, out.permute(0, 3, 1, 2), **FLOAT32_ULPS)  # two layouts: other resize kernels
    top_left = common.resize_with_pad_top_left(image.permute(0, 3, 1, 2), 8, 8, pad_value=-1.0)
    assert top_left[0, :, 4:].eq(0.5).all() and top_left[0, :, :4].eq(-1).all()


def test_beta_draws_are_torch_distributions_beta_and_per_sample_draws_follow_the_seed() -> None:
    torch.manual_seed(3)
    expected = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0)).sample((5,))
    torch.manual_seed(3)
    assert torch.equal(common.sample_beta(1.5, 1.0, 5), expected)
    draws = {"alpha": 1.5, "beta": 1.0, "scale": 0.999, "offset": 0.001}
    noise, time = common.per_sample_noise_and_time([7, 8, 9], (4, 3), "cpu", **draws)
    noise_rev, time_rev = common.per_sample_noise_and_time([9, 7], (4, 3), "cpu", **draws)
    assert torch.equal(noise_rev, noise[[2, 0]]) and torch.equal(time_rev, time[[2, 0]])
    assert ((time > 0.001) & (time < 1.0)).all() and not torch.equal(noise[0], noise[1])


def test_euler_integrates_from_noise_at_t1_to_t0() -> None:
    noise = torch.randn(2, 3, 4)
    seen: list[float] = []
    out = common.euler_integrate(lambda x, t: torch.full_like(x, 2.0), noise, 4,
                                 on_step=lambda t, x, v: seen.append(float(t[0])))
    torch.testing.assert_close(out, noise - 2.0)
    assert seen == [1.0, 0.75, 0.5, 0.25]
    x_t, u_t = common.flow_matching_pair(torch.zeros(1, 2, 2), torch.ones(1, 2, 2), torch.tensor([0.25]))
    assert x_t.eq(0.25).all() and u_t.eq(1.0).all()


# --- the joint layer protocol --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=PI_FIXTURES)
def tiny_policy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PI0Policy]:
    name = request.param
    directory = vf.loadable_pretrained_copy(name, tmp_path_factory.mktemp(name),
                                            {"dimension_overrides": vf.pi_dimension_overrides(name)})
    return name, load_pretrained(Path(directory))


def _record_calls(policy: PI0Policy, log: list[tuple[str, str, int]]) -> list[torch.utils.hooks.RemovableHandle]:
    handles = []
    for index, (vlm_layer, expert_layer) in enumerate(policy.fsdp_unit_groups()):
        for role, layer in (("vlm", vlm_layer), ("expert", expert_layer)):
            handles.append(layer.register_forward_pre_hook(lambda m, a, r=role, i=index: log.append(("pre", r, i))))
            handles.append(layer.register_forward_hook(lambda m, a, o, r=role, i=index: log.append(("post", r, i))))
    return handles


def test_units_are_the_joint_layers_and_the_vision_layers(tiny_policy: tuple[str, PI0Policy]) -> None:
    _, policy = tiny_policy
    groups = policy.fsdp_unit_groups()
    assert len(groups) == 2
    for vlm_layer, expert_layer in groups:
        assert type(vlm_layer) is VLMDecoderLayer and type(expert_layer) is ExpertDecoderLayer
    classes = {type(module).__name__ for module in policy.modules()}
    assert SIGLIP_LAYER_CLASS in classes and set(policy._checkpoint_modules) <= classes


def test_every_pass_runs_both_forwards_of_every_joint_layer_nested(tiny_policy: tuple[str, PI0Policy]) -> None:
    name, policy = tiny_policy
    batch = vf.preprocessed_batch(name)
    num_steps = policy.config.num_inference_steps
    log: list[tuple[str, str, int]] = []
    handles = _record_calls(policy, log)
    try:
        policy.train()
        policy(batch)
        training = list(log)
        log.clear()
        policy.eval()
        policy.predict_action_chunk(batch)
    finally:
        for handle in handles:
            handle.remove()
    one_pass = [event for i in range(2) for event in
                (("pre", "vlm", i), ("pre", "expert", i), ("post", "expert", i), ("post", "vlm", i))]
    assert training == one_pass
    assert log == one_pass * (1 + num_steps)  # the prefix-only pass, then every denoising step


def test_an_absent_stream_never_touches_its_layers_weights(tiny_policy: tuple[str, PI0Policy]) -> None:
    """NaN weights in the stream a pass leaves out must not reach that pass's outputs."""
    name, source = tiny_policy
    policy = type(source)(source.config, source.input_features, source.output_features)
    policy.load_state_dict(source.state_dict())
    policy.eval()
    batch = vf.preprocessed_batch(name)
    images, img_masks = policy.preprocess_images(batch)
    tokens, masks = batch["observation.language.tokens"], batch["observation.language.attention_mask"]
    model = policy.model
    pwe = model.paligemma_with_expert
    with torch.no_grad():
        for param in pwe.expert.layers.parameters():
            param.fill_(float("nan"))
        prefix, pad, att = model.embed_prefix(images, img_masks, tokens, masks)
        mask = common.attention_masks_4d(common.make_att_2d_masks(pad, att))
        prefix_out, suffix_out, cache = pwe(prefix, None, mask, common.position_ids_from_pad_masks(pad),
                                           fill_cache=True)
        assert suffix_out is None and torch.isfinite(prefix_out).all()
        assert cache is not None and all(torch.isfinite(kv.key).all() for kv in cache)
        policy.load_state_dict(source.state_dict())
        for param in pwe.vlm.layers.parameters():
            param.fill_(float("nan"))
        velocity = model.denoise_step(policy.prepare_state(batch), pad, cache,
                                      torch.randn(2, policy.config.chunk_size, policy.config.max_action_dim),
                                      torch.ones(2))
    assert torch.isfinite(velocity).all()


def test_gradient_checkpointing_recomputes_the_joint_layers_with_the_same_numbers(
        tiny_policy: tuple[str, PI0Policy]) -> None:
    name, policy = tiny_policy
    batch = vf.preprocessed_batch(name)
    ref = vf.reference(name)
    checkpointed_config = type(policy.config)(**{**vars(policy.config), "gradient_checkpointing": True})
    checkpointed = type(policy)(checkpointed_config, policy.input_features, policy.output_features)
    checkpointed.load_state_dict(policy.state_dict())
    # accelerator.activation_checkpointing: wrap.py's transform on the blocks the policy declares.
    transformed = type(policy)(policy.config, policy.input_features, policy.output_features)
    transformed.load_state_dict(policy.state_dict())
    blocks = declared_checkpoint_blocks(transformed)
    assert [module for _, module in blocks] == [vlm for vlm, _ in transformed.fsdp_unit_groups()]
    for _, module in blocks:
        checkpoint_activations(module)
    results = []
    for candidate in (policy, checkpointed, transformed):
        candidate.train()
        candidate.zero_grad(set_to_none=True)
        loss, _ = candidate(batch, noise=ref["input.noise"], time=ref["input.time"])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in candidate.named_parameters()
                                        if p.grad is not None}))
    for loss, grads in results[1:]:
        assert torch.equal(results[0][0], loss)
        assert results[0][1].keys() == grads.keys()
        for key, grad in results[0][1].items():
            torch.testing.assert_close(grads[key], grad, atol=0, rtol=0, msg=key)
    policy.zero_grad(set_to_none=True)


# --- FSDP2: each joint layer one grouped unit ------------------------------------------------------------------

_FSDP_WORKER = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from lerobot_mg.policies.registry import load_pretrained
    from tests import vla_fixtures as vf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name in ("pi0_tiny", "pi05_tiny"):
        directory = vf.loadable_pretrained_copy(name, Path(tempfile.mkdtemp()),
                                                {"dimension_overrides": vf.pi_dimension_overrides(name)})
        plain, sharded = load_pretrained(directory), load_pretrained(directory)
        for module in list(sharded.modules()):
            if type(module).__name__ in sharded._fsdp_wrap_modules:
                fully_shard(module, mesh=mesh)
        for group in sharded.fsdp_unit_groups():
            fully_shard(list(group), mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        register_fsdp_forward_method(sharded, "predict_action_chunk")
        ref, batch = vf.reference(name), vf.preprocessed_batch(name)
        losses, grads, chunks = [], [], []
        for policy in (plain, sharded):
            policy.train()
            loss, _ = policy(batch, noise=ref["input.noise"], time=ref["input.time"])
            loss.backward()
            losses.append(loss.item())
            grads.append({n: None if p.grad is None else (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                                          else p.grad) for n, p in policy.named_parameters()})
            policy.eval()
            chunks.append(policy.predict_action_chunk(batch, noise=ref["input.sample_noise"]))
        assert grads[0].keys() == grads[1].keys()
        assert all((grads[0][n] is None) == (grads[1][n] is None) for n in grads[0])
        results[name] = {"loss": abs(losses[0] - losses[1]),
                         "grad": max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]
                                     if grads[0][n] is not None),
                         "chunk": (chunks[0] - chunks[1]).abs().max().item()}
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.destroy_process_group()
""")


def test_joint_layers_as_grouped_fsdp2_units_train_and_infer_like_one_process(tmp_path: Path) -> None:
    """fully_shard([vlm_layer_i, expert_layer_i]) per joint layer, the SigLIP layers and the root, on 2 gloo ranks:
    the same loss, gradients and action chunk as the unsharded policy (training, the prefix pass and every
    denoising step gather each unit when it computes)."""
    worker = tmp_path / "worker.py"
    worker.write_text(_FSDP_WORKER)
    result = tmp_path / "result.json"
    done = spawn_ranks([PYTHON, str(worker), str(result)], 2, clean_env({"PYTHONPATH": str(REPO),
                                                                         "OMP_NUM_THREADS": "1"}), REPO, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    for name, diffs in json.loads(result.read_text()).items():
        assert diffs["loss"] == 0.0 and diffs["chunk"] == 0.0, (name, diffs)
        assert diffs["grad"] <= 1e-6, (name, diffs)
