"""pi0, pi0.5 and SmolVLA on batches that mix robots (a dataset mixture), with LeRobot 0.6.1's tiny fixtures.

- Action dims a sample's robot lacks (``ACTION_DIM_PAD_KEY``) count in neither the sum nor the count of the loss: the
  sample trains exactly as under a policy whose action feature has its robot's dims, and its padded targets change
  neither the loss nor a gradient. The batch's loss is the plain mean of its samples' losses, so it is the mean of
  any equal split's losses: data-parallel ranks train the same whatever samples each one holds.
- A camera a sample's source lacks (``empty_camera_key``) is LeRobot's empty camera for that sample alone (image -1,
  mask False): its actions are those LeRobot computes without the camera, the other samples' are untouched.
- Without the keys the numbers are LeRobot's: the fixture tests (test_pi0.py, test_smolvla.py) check them; here,
  masks that mark nothing change no sample's loss and no action.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lerobot_mg.policies.base import ACTION_DIM_PAD_KEY, PreTrainedPolicy, empty_camera_key
from lerobot_mg.policies.registry import load_pretrained
from lerobot_mg.policies.vla.common import reduce_action_losses
from lerobot_mg.processors import load_processors
from lerobot_mg.step import to_device
from tests import vla_fixtures as vf

TOLERANCE = {"atol": vf.ATOL_TENSORS, "rtol": 0.0}
LOSS_TOLERANCE = {"atol": vf.ATOL_LOSSES, "rtol": 1e-6}
# Sample 0's robot has the first 3 of the policy's 5 action dims; sample 1's has all 5.
REAL_DIMS = (3, 5)


def _load(name: str, directory: Path) -> PreTrainedPolicy:
    if name == "smolvla_tiny":  # its vlm_model_name is relative to the fixtures folder, as LeRobot wrote it
        copy = directory / "pretrained_model"
        shutil.copytree(vf.pretrained_model_dir(name), copy)
        config = vf.config_json(name)
        config["vlm_model_name"] = str(vf.resolve_fixture_path(config["vlm_model_name"]))
        (copy / "config.json").write_text(json.dumps(config, indent=4))
    else:
        copy = vf.loadable_pretrained_copy(name, directory, {"dimension_overrides": vf.pi_dimension_overrides(name)})
    return load_pretrained(copy)


@pytest.fixture(scope="module", params=vf.VLA_FIXTURES)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, PreTrainedPolicy, dict[str, torch.Tensor]]:
    name = request.param
    return name, _load(name, tmp_path_factory.mktemp(name)), vf.reference(name)


def _narrowed(policy: PreTrainedPolicy, action_dim: int) -> PreTrainedPolicy:
    """The same weights under an action feature of ``action_dim`` dims (the projections are max_action_dim wide,
    so the network is the same): how a robot with that many dims trains alone."""
    outputs = {"action": {"type": "ACTION", "shape": [action_dim]}}
    narrow = type(policy)(policy.config, policy.input_features, outputs, load_backbone_weights=False)
    narrow.load_state_dict(policy.state_dict())
    return narrow.train(policy.training)


def _dim_is_pad(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    action_dim = batch["action"].shape[-1]
    return torch.arange(action_dim)[None, :] >= torch.tensor(REAL_DIMS)[:, None]


def _loss(policy: PreTrainedPolicy, batch: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
          reduction: str = "mean") -> torch.Tensor:
    return policy(batch, noise=ref["input.noise"], time=ref["input.time"], reduction=reduction)[0]


# --- padded action dims -------------------------------------------------------------------------------------------


def test_padded_action_dims_train_as_the_robots_own_action_dim(
        loaded: tuple[str, PreTrainedPolicy, dict[str, torch.Tensor]]) -> None:
    name, policy, ref = loaded
    policy.train()
    batch = vf.preprocessed_batch(name)
    mixed = {**batch, ACTION_DIM_PAD_KEY: _dim_is_pad(batch)}
    with torch.no_grad():
        per_sample = _loss(policy, mixed, ref, "none")
        loss = _loss(policy, mixed, ref)
        alone = [_loss(_narrowed(policy, dims), {**batch, "action": batch["action"][..., :dims]}, ref, "none")[index]
                 for index, dims in enumerate(REAL_DIMS)]
    torch.testing.assert_close(per_sample, torch.stack(alone), **LOSS_TOLERANCE)
    # The batch's loss is the plain mean of the samples' losses, whatever their robots' number of action dims.
    torch.testing.assert_close(loss, per_sample.mean(), **LOSS_TOLERANCE)
    assert REAL_DIMS[0] < batch["action"].shape[-1]  # sample 0 has padded dims: the mask is exercised


def test_a_mixed_batchs_loss_is_the_mean_of_its_halves_losses(
        loaded: tuple[str, PreTrainedPolicy, dict[str, torch.Tensor]]) -> None:
    """Two ranks holding one sample each (one robot per rank) train as one rank holding both."""
    name, policy, ref = loaded
    policy.train()
    batch = vf.preprocessed_batch(name)
    mixed = {**batch, ACTION_DIM_PAD_KEY: _dim_is_pad(batch)}
    with torch.no_grad():
        loss = _loss(policy, mixed, ref)
        halves = [policy({key: value[index:index + 1] for key, value in mixed.items()},
                         noise=ref["input.noise"][index:index + 1], time=ref["input.time"][index:index + 1])[0]
                  for index in range(2)]
    torch.testing.assert_close(loss, torch.stack(halves).mean(), **LOSS_TOLERANCE)


def _mixed_losses(samples: int, steps: int, dims: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Elementwise losses of a batch that mixes a 2-dim robot (even samples) with a ``dims``-dim one (odd samples),
    each sample's episode ending at its own step."""
    generator = torch.Generator().manual_seed(0)
    losses = torch.rand((samples, steps, dims), generator=generator)
    real_dims = torch.tensor([2 if index % 2 == 0 else dims for index in range(samples)])
    dim_is_pad = torch.arange(dims)[None, :] >= real_dims[:, None]
    ends = torch.randint(1, steps + 1, (samples,), generator=generator)
    step_is_pad = torch.arange(steps)[None, :] >= ends[:, None]
    return losses, {ACTION_DIM_PAD_KEY: dim_is_pad, "action_is_pad": step_is_pad}


@pytest.mark.parametrize("mask_steps", [False, True])
def test_the_mixed_loss_does_not_depend_on_how_the_batch_is_split(mask_steps: bool) -> None:
    losses, masks = _mixed_losses(samples=8, steps=5, dims=14)
    loss = reduce_action_losses(masks, losses, "mean", mask_steps=mask_steps)
    # Each rank one robot (rank 0 the 2-dim samples, rank 1 the 14-dim ones), or any other split of equal sizes.
    for ranks in ([[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[7, 0], [3, 4], [6, 1], [2, 5]]):
        means = [reduce_action_losses({key: value[part] for key, value in masks.items()}, losses[part], "mean",
                                      mask_steps=mask_steps) for part in map(torch.tensor, ranks)]
        torch.testing.assert_close(torch.stack(means).mean(), loss)
    per_sample = reduce_action_losses(masks, losses, "none", mask_steps=mask_steps)
    torch.testing.assert_close(loss, per_sample.mean())
    valid = ~masks[ACTION_DIM_PAD_KEY][:, None, :] & (~masks["action_is_pad"][:, :, None] if mask_steps else True)
    expected = torch.stack([sample[real].mean() for sample, real in zip(losses, valid.expand_as(losses), strict=True)])
    torch.testing.assert_close(per_sample, expected)


def test_without_the_dim_mask_the_loss_is_lerobots_entry_weighted_mean() -> None:
    losses, masks = _mixed_losses(samples=4, steps=5, dims=3)
    step_is_pad = {"action_is_pad": masks["action_is_pad"]}
    valid = (~step_is_pad["action_is_pad"])[:, :, None].expand_as(losses)
    assert torch.equal(reduce_action_losses(step_is_pad, losses, "mean", mask_steps=True),
                       (losses * valid).sum() / valid.sum())
    assert torch.equal(reduce_action_losses(step_is_pad, losses, "mean", mask_steps=False), losses.mean())


def test_padded_action_targets_change_neither_the_loss_nor_the_gradients(
        loaded: tuple[str, PreTrainedPolicy, dict[str, torch.Tensor]]) -> None:
    name, policy, ref = loaded
    policy.train()
    batch = vf.preprocessed_batch(name)
    dim_is_pad = _dim_is_pad(batch)
    garbage = batch["action"].masked_fill(dim_is_pad[:, None, :], 0.0) + 7.0 * dim_is_pad[:, None, :]
    results = []
    for actions in (batch["action"], garbage):
        policy.zero_grad(set_to_none=True)
        loss = _loss(policy, {**batch, "action": actions, ACTION_DIM_PAD_KEY: dim_is_pad}, ref)
        loss.backward()
        grads = {key: param.grad.clone() for key, param in policy.named_parameters() if param.grad is not None}
        results.append((loss.detach(), grads, _loss(policy, {**batch, "action": actions}, ref).detach()))
    policy.zero_grad(set_to_none=True)
    (loss, grads, unmasked), (loss_garbage, grads_garbage, unmasked_garbage) = results
    assert torch.equal(loss, loss_garbage)
    assert grads.keys() == grads_garbage.keys() and len(grads) > 10
    for key, grad in grads.items():
        assert torch.equal(grad, grads_garbage[key]), key
    assert not torch.allclose(unmasked, unmasked_garbage)  # without the mask the padded targets do count


def test_masks_that_mark_nothing_change_nothing(loaded: tuple[str, PreTrainedPolicy, dict[str, torch.Tensor]]
                                                ) -> None:
    name, policy, ref = loaded
    policy.train()
    batch = vf.preprocessed_batch(name)
    nothing = {ACTION_DIM_PAD_KEY: torch.zeros(batch["action"].shape[::2], dtype=torch.bool),
               **{empty_camera_key(key): torch.zeros(2, dtype=torch.bool) for key in _cameras(policy, batch)}}
    with torch.no_grad():
        per_sample = _loss(policy, {**batch, **nothing}, ref, "none")
        torch.testing.assert_close(per_sample, _loss(policy, batch, ref, "none"), **LOSS_TOLERANCE)
        # A mixture's batch loss is the mean of its samples' (the same as LeRobot's for pi0 and pi0.5, which count
        # every step; SmolVLA's samples, whose episodes end at different steps, weigh alike instead of by steps).
        mixed_loss = _loss(policy, {**batch, **nothing}, ref)
        torch.testing.assert_close(mixed_loss, per_sample.mean(), **LOSS_TOLERANCE)
        if name != "smolvla_tiny":
            torch.testing.assert_close(mixed_loss, _loss(policy, batch, ref), **LOSS_TOLERANCE)
        policy.eval()
        observation = {key: value for key, value in batch.items() if key.startswith("observation.")}
        assert torch.equal(_chunk(policy, {**observation, **nothing}, ref), _chunk(policy, observation, ref))


# --- empty cameras ------------------------------------------------------------------------------------------------


def _cameras(policy: PreTrainedPolicy, batch: dict[str, torch.Tensor]) -> list[str]:
    return [key for key in policy.image_keys if key in batch]


def _images(policy: PreTrainedPolicy, batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    prepare = policy.prepare_images if hasattr(policy, "prepare_images") else policy.preprocess_images
    return prepare(batch)


def _chunk(policy: PreTrainedPolicy, batch: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
           samples: slice = slice(None)) -> torch.Tensor:
    return policy.predict_action_chunk(batch, noise=ref["input.sample_noise"][samples])


def test_an_empty_camera_is_lerobots_empty_camera_for_its_samples_only(
        loaded: tuple[str, PreTrainedPolicy, dict[str, torch.Tensor]]) -> None:
    name, policy, ref = loaded
    policy.eval()
    observation = {key: value for key, value in vf.preprocessed_batch(name).items() if key.startswith("observation.")}
    camera = _cameras(policy, observation)[-1]
    index = policy.image_keys.index(camera)
    # The source of sample 0 has no such camera: the mixture gives zeros and marks it.
    mixed = {**observation, camera: observation[camera].clone(), empty_camera_key(camera): torch.tensor([True, False])}
    mixed[camera][0] = 0.0
    images, masks = _images(policy, mixed)
    plain_images, plain_masks = _images(policy, observation)
    assert torch.equal(images[index][0], torch.full_like(images[index][0], -1.0))
    assert masks[index].tolist() == [False, True]
    assert torch.equal(images[index][1], plain_images[index][1])
    for other, (image, mask) in enumerate(zip(images, masks, strict=True)):
        if other != index:
            assert torch.equal(image, plain_images[other]) and torch.equal(mask, plain_masks[other])
    chunk = _chunk(policy, mixed, ref)
    assert torch.equal(chunk[1], _chunk(policy, observation, ref)[1])
    # What sample 0's image held does not matter: nothing attends to a masked camera.
    mixed[camera][0] = observation[camera][0]
    assert torch.equal(_chunk(policy, mixed, ref), chunk)
    if len(_cameras(policy, observation)) > 1:
        # LeRobot's own treatment of a camera the batch lacks: pi0 appends an all -1 masked image, SmolVLA (with
        # empty_cameras=0) leaves it out; either way sample 0's actions are the same.
        lacking = {key: value[:1] for key, value in observation.items() if key != camera}
        torch.testing.assert_close(chunk[:1], _chunk(policy, lacking, ref, slice(0, 1)), **TOLERANCE)
    else:
        assert name == "pi05_tiny"  # its one camera: LeRobot refuses a batch without any


# --- through the preprocessor -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", vf.VLA_FIXTURES)
def test_the_preprocessor_hands_the_mixture_keys_to_the_policy_unchanged(name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(vf.FIXTURES)  # the fixtures' tokenizer paths are relative to it, as LeRobot wrote them
    preprocessor, _ = load_processors(vf.pretrained_model_dir(name))
    tensors, tasks = vf.reference(name), vf.reference_json(name)["tasks"]
    raw = {key.removeprefix("input.").removesuffix(".uint8"): value for key, value in tensors.items()
           if key.startswith("input.")}
    cameras = [key for key in raw if key.startswith("observation.images.")]
    marks = {ACTION_DIM_PAD_KEY: _dim_is_pad(raw), empty_camera_key(cameras[0]): torch.tensor([True, False])}
    out = preprocessor(to_device({**raw, **marks, "task": list(tasks)}, torch.device("cpu"), uint8_keys=cameras))
    for key, value in marks.items():
        assert out[key].dtype == torch.bool and torch.equal(out[key], value), key
