"""The numerics pi0, pi0.5 and SmolVLA share, written to give LeRobot 0.6.1's numbers bit for bit.

Flow matching (the openpi convention LeRobot follows): a training sample mixes the action chunk with noise,
``x_t = t * noise + (1 - t) * actions``, and the model learns the velocity ``u_t = noise - actions``; at inference
forward Euler integrates the predicted velocity from t = 1 (pure noise) to t = 0 in ``num_steps`` equal steps.
Training times follow ``Beta(alpha, beta) * scale + offset``.

Attention between the prefix (images, language) and the suffix (state, noisy actions) is described per token by a
pad mask (a real token or padding) and an "autoregressive" mask: a token attends to every valid token whose running
sum of that mask is at most its own (see :func:`make_att_2d_masks`).

Every draw of noise or time can come from an explicit ``torch.Generator`` (one per sample, seeded from the batch's
``sample_seed``) so that training is the same on every data-parallel layout; without one the global RNG is used,
as LeRobot does.

A batch of a dataset mixture mixes robots: per sample, action dimensions that are padding (``ACTION_DIM_PAD_KEY``)
and cameras its source does not have (``empty_camera_key``). :func:`blank_empty_camera`,
:func:`zero_padded_action_dims` and :func:`reduce_action_losses` give them LeRobot's treatment of an empty camera
and of the action dims past the action feature, per sample; a batch without those keys computes LeRobot's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from lerobot_mg.policies.base import ACTION_DIM_PAD_KEY, empty_camera_key

# The additive value of a masked position in the 4D attention masks (openpi's constant, kept by LeRobot).
ATTENTION_MASK_VALUE = -2.3819763e38


# ---------------------------------------------------------------------------------------------------------------
# Time embedding and masks
# ---------------------------------------------------------------------------------------------------------------


# The batch keys of the tokenised task instruction, as LeRobot's tokenizer step writes them (the processors'
# tokenizer step, lerobot_mg.processors.language, fills them; every VLA reads them).
LANGUAGE_TOKENS = "observation.language.tokens"
LANGUAGE_ATTENTION_MASK = "observation.language.attention_mask"


def example_language(batch_size: int, length: int) -> dict[str, Tensor]:
    """A prompt of ``length`` tokens per sample (token 0, every position attended), made on the current default
    device: the language part of a VLA's ``example_batch``."""
    return {LANGUAGE_TOKENS: torch.zeros(batch_size, length, dtype=torch.long),
            LANGUAGE_ATTENTION_MASK: torch.ones(batch_size, length, dtype=torch.bool)}


def init_like_transformers(module: nn.Module, std: float, skip: Collection[nn.Module] = ()) -> None:
    """transformers' initialisation of a freshly built language model, as LeRobot's VLAs get it: linear and embedding
    weights ~ N(0, std) in module order, biases and the embedding's padding row zero; ``skip``'s modules untouched
    (norms set their own weights)."""
    skipped = {id(child) for child in skip}
    for child in module.modules():
        if id(child) in skipped:
            continue
        if isinstance(child, nn.Linear):
            nn.init.normal_(child.weight, std=std)
            if child.bias is not None:
                nn.init.zeros_(child.bias)
        elif isinstance(child, nn.Embedding):
            nn.init.normal_(child.weight, std=std)
            if child.padding_idx is not None:
                with torch.no_grad():
                    child.weight[child.padding_idx].zero_()


def sinusoidal_time_embedding(time: Tensor, dimension: int, min_period: float, max_period: float) -> Tensor:
    """(B, dimension) sine-cosine embedding of scalar times (B,): periods spaced geometrically from ``min_period``
    to ``max_period``, sines in the first half, cosines in the second. Computed in float64 (float32 on MPS, which
    has no float64), so the result's dtype is that; callers cast it to the time's dtype."""
    if dimension % 2 != 0:
        raise ValueError(f"the time embedding's dimension ({dimension}) must be even")
    if time.ndim != 1:
        raise ValueError(f"time must have shape (batch_size,), got {tuple(time.shape)}")
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=dtype, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    angular_frequency = 1.0 / period * 2 * math.pi
    angle = angular_frequency[None, :] * time[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)


def make_att_2d_masks(pad_masks: Tensor, att_masks: Tensor) -> Tensor:
    """(B, N, N) bool: query i may attend key j when both are real tokens (``pad_masks``) and the running sum of
    ``att_masks`` up to j is at most that up to i. All-zero ``att_masks`` is full attention, all ones is causal,
    ``[0 0 0 1 1 1]`` is a prefix with a causal tail, and a 1 starts a new block that sees every earlier block."""
    if att_masks.ndim != 2:
        raise ValueError(f"att_masks must be (B, N), got {att_masks.ndim} dims")
    if pad_masks.ndim != 2:
        raise ValueError(f"pad_masks must be (B, N), got {pad_masks.ndim} dims")
    cumulative = torch.cumsum(att_masks, dim=1)
    causal_2d = cumulative[:, None, :] <= cumulative[:, :, None]
    valid_2d = pad_masks[:, None, :] * pad_masks[:, :, None]
    return causal_2d & valid_2d


def leading_ones(batch_size: int, length: int, ones: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(batch_size, length) autoregressive masks ``[1] * ones + [0] * (length - ones)`` per sample, made on the
    device (a mask built from a Python list would be copied to it, waiting for it)."""
    return (torch.arange(length, device=device) < ones).to(dtype)[None, :].expand(batch_size, length)


def attention_masks_4d(att_2d_masks: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """(B, 1, Nq, Nk) additive mask for eager attention: 0 where allowed, :data:`ATTENTION_MASK_VALUE` elsewhere
    (float32 unless ``dtype`` is given)."""
    mask = torch.where(att_2d_masks[:, None, :, :], 0.0, ATTENTION_MASK_VALUE)
    return mask if dtype is None else mask.to(dtype=dtype)


def position_ids_from_pad_masks(pad_masks: Tensor, offset: Tensor | None = None) -> Tensor:
    """Position of each token: the number of real tokens before it (padding repeats its neighbour's position),
    plus ``offset`` (B, 1) (the prefix length when the suffix is run against a cached prefix)."""
    positions = torch.cumsum(pad_masks, dim=1) - 1
    return positions if offset is None else offset + positions


# ---------------------------------------------------------------------------------------------------------------
# Vectors and images
# ---------------------------------------------------------------------------------------------------------------


def pad_vector(vector: Tensor, new_dim: int) -> Tensor:
    """Zero-pad the last dimension to ``new_dim``; a vector already that wide or wider is returned unchanged."""
    if vector.shape[-1] >= new_dim:
        return vector
    return F.pad(vector, (0, new_dim - vector.shape[-1]))


def _resized_size(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
    ratio = max(width / target_width, height / target_height)
    return int(height / ratio), int(width / ratio)


def resize_with_pad_centered(images: Tensor, height: int, width: int, mode: str = "bilinear") -> Tensor:
    """Resize without distortion to (height, width), padding with black around the centre (openpi's rule, which
    pi0 and pi0.5 use). Accepts (B, H, W, C) or (B, C, H, W) (channels-last when the last axis is at most 4 wide;
    a 3-dim image gains a batch axis) and returns the same layout. float32 images must be in [0, 1] and are
    clamped there after interpolation; uint8 images are rounded."""
    channels_last = images.shape[-1] <= 4
    if images.dim() == 3:
        images = images.unsqueeze(0)
    if channels_last:
        images = images.permute(0, 3, 1, 2)
    current_height, current_width = images.shape[2:]
    resized_height, resized_width = _resized_size(current_height, current_width, height, width)
    resized = F.interpolate(images, size=(resized_height, resized_width), mode=mode,
                            align_corners=False if mode == "bilinear" else None)
    if images.dtype == torch.uint8:
        resized = torch.round(resized).clamp(0, 255).to(torch.uint8)
    elif images.dtype == torch.float32:
        resized = resized.clamp(0.0, 1.0)
    else:
        raise ValueError(f"resize_with_pad_centered takes uint8 or float32 images, got {images.dtype}")
    pad_top, extra_height = divmod(height - resized_height, 2)
    pad_left, extra_width = divmod(width - resized_width, 2)
    padded = F.pad(resized, (pad_left, pad_left + extra_width, pad_top, pad_top + extra_height),
                   mode="constant", value=0)
    return padded.permute(0, 2, 3, 1) if channels_last else padded


def resize_with_pad_top_left(images: Tensor, height: int, width: int, *, pad_value: float) -> Tensor:
    """Resize (B, C, H, W) without distortion to (height, width), padding on the left and top with ``pad_value``
    (SmolVLA's rule). An image already that size is returned as is."""
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    current_height, current_width = images.shape[2:]
    if current_height == height and current_width == width:
        return images
    resized_height, resized_width = _resized_size(current_height, current_width, height, width)
    resized = F.interpolate(images, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    return F.pad(resized, (max(0, width - resized_width), 0, max(0, height - resized_height), 0), value=pad_value)


# ---------------------------------------------------------------------------------------------------------------
# Flow matching: draws, training target, sampling
# ---------------------------------------------------------------------------------------------------------------


def sample_noise(shape: Sequence[int], device: torch.device | str, generator: torch.Generator | None = None) -> Tensor:
    """Standard-normal float32 noise (x at t = 1)."""
    return torch.normal(mean=0.0, std=1.0, size=tuple(shape), dtype=torch.float32, device=device, generator=generator)


def sample_beta(alpha: float, beta: float, batch_size: int, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> Tensor:
    """(batch_size,) float32 draws of Beta(alpha, beta) on ``device`` (the generator's, by default; the CPU without
    one); with no generator the same numbers as ``torch.distributions.Beta(alpha, beta).sample((batch_size,))`` from
    that device's global RNG (it samples the same two-component Dirichlet)."""
    if device is None:
        device = generator.device if generator is not None else "cpu"
    # Built on the device (a tensor made from Python numbers would be copied to it, waiting for it).
    concentration = torch.full((batch_size, 2), beta, dtype=torch.float32, device=device)
    concentration[:, 0] = alpha
    if concentration.is_meta:  # shapes only (the memory plan, the FLOPs count): the draw has no meta kernel
        return concentration[..., 0]
    return torch._sample_dirichlet(concentration, generator=generator)[..., 0]


def sample_time_beta(batch_size: int, device: torch.device | str, *, alpha: float, beta: float, scale: float,
                     offset: float, generator: torch.Generator | None = None) -> Tensor:
    """(batch_size,) float32 flow-matching times ``Beta(alpha, beta) * scale + offset``, drawn on ``device`` (from
    ``generator``, a generator of that device, when given)."""
    time = sample_beta(alpha, beta, batch_size, generator, device) * scale + offset
    return time.to(dtype=torch.float32)


def per_sample_noise_and_time(seeds: Sequence[int], noise_shape: Sequence[int], device: torch.device | str, *,
                              alpha: float, beta: float, scale: float, offset: float) -> tuple[Tensor, Tensor]:
    """Noise (B, *noise_shape) and times (B,) where sample b's draws come from its own generator of ``device``
    seeded with ``seeds[b]`` (noise first, then time): a sample trains on the same draws whatever rank or
    micro-batch it is in. Drawn on the device: nothing is copied to it (on the CPU, the numbers of a CPU generator;
    a GPU's generator draws other numbers from the same seed)."""
    noises, times = [], []
    for seed in seeds:
        # On the meta device (shapes only) a CPU generator: the meta device has none, and draws nothing from it.
        generator = torch.Generator(device="cpu" if torch.device(device).type == "meta" else device)
        generator.manual_seed(int(seed))
        noises.append(sample_noise(noise_shape, device, generator))
        times.append(sample_time_beta(1, device, alpha=alpha, beta=beta, scale=scale, offset=offset,
                                      generator=generator))
    return torch.stack(noises), torch.cat(times)


def flow_matching_pair(actions: Tensor, noise: Tensor, time: Tensor) -> tuple[Tensor, Tensor]:
    """(x_t, u_t): the noisy actions the model sees at times ``time`` (B,) and the velocity it must predict."""
    t = time[:, None, None]
    x_t = t * noise + (1 - t) * actions
    u_t = noise - actions
    return x_t, u_t


def flow_matching_losses(u_t: Tensor, v_t: Tensor) -> Tensor:
    """Elementwise squared error between target and predicted velocity (no reduction)."""
    return F.mse_loss(u_t, v_t, reduction="none")


def euler_integrate(velocity: Callable[[Tensor, Tensor], Tensor], noise: Tensor, num_steps: int,
                    on_step: Callable[[Tensor, Tensor, Tensor], None] | None = None) -> Tensor:
    """Integrate ``velocity(x_t, t)`` (t a float32 (B,) tensor) from t = 1 to 0 with ``num_steps`` forward Euler
    steps: t = 1, 1 - 1/n, ..., x_t <- x_t - v_t / n. ``on_step(t, x_t, v_t)``, if given, sees every step."""
    batch_size = noise.shape[0]
    dt = -1.0 / num_steps
    x_t = noise
    for step in range(num_steps):
        time = 1.0 + step * dt
        time_tensor = torch.full((batch_size,), time, dtype=torch.float32, device=noise.device)
        v_t = velocity(x_t, time_tensor)
        if on_step is not None:
            on_step(time_tensor, x_t, v_t)
        x_t = x_t + dt * v_t
    return x_t


# ---------------------------------------------------------------------------------------------------------------
# Batches that mix robots: empty cameras and padded action dimensions, per sample
# ---------------------------------------------------------------------------------------------------------------


def blank_empty_camera(batch: dict[str, Tensor], camera: str, image: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``camera``'s image (B, ...) already mapped to [-1, 1] and its mask (B,), with LeRobot's empty camera in the
    samples the batch's ``empty_camera_key(camera)`` (B,) marks: image all -1, mask False (nothing attends to its
    tokens). Without the key: unchanged."""
    is_empty = batch.get(empty_camera_key(camera))
    if is_empty is None:
        return image, mask
    is_empty = is_empty.to(device=image.device, dtype=torch.bool)
    return image.masked_fill(is_empty.view(-1, *[1] * (image.ndim - 1)), -1.0), mask & ~is_empty


def zero_padded_action_dims(batch: dict[str, Tensor], actions: Tensor) -> Tensor:
    """The action chunk (B, T, D) with the dimensions the batch's ``ACTION_DIM_PAD_KEY`` (B, D) marks set to 0, as
    the dimensions past the action feature are (:func:`pad_vector`): the noisy actions the model reads carry nothing
    of a padded target. Without the key: unchanged."""
    dim_is_pad = batch.get(ACTION_DIM_PAD_KEY)
    if dim_is_pad is None:
        return actions
    return actions.masked_fill(dim_is_pad[:, None, :], 0.0)


def reduce_action_losses(batch: dict[str, Tensor], losses: Tensor, reduction: str, *, mask_steps: bool) -> Tensor:
    """The training loss from the elementwise losses (B, T, D) of the action feature's dims: the whole batch's
    (``reduction="mean"``, a scalar) or each sample's (``"none"``, (B,)).

    Without ``ACTION_DIM_PAD_KEY`` in the batch this is LeRobot's loss: with ``mask_steps`` (SmolVLA) the sum over
    the chunk steps inside the episode (``action_is_pad`` (B, T) False) divided by their count x D, the batch's or
    each sample's; pi0 and pi0.5 count every step, as LeRobot's, so theirs is the plain mean.

    With ``ACTION_DIM_PAD_KEY`` (B, D) (a dataset mixture's batch: its True dims are padding) each sample's loss is
    the mean over its real entries (dims not padded and, with ``mask_steps``, steps inside the episode), and the
    batch's loss is the plain mean of the samples' losses. Every sample then weighs the same whatever its robot's
    action dims, and since data-parallel ranks hold micro-batches of one size, the mean of the ranks' losses is the
    global batch's: the gradient does not depend on how the batch is split over ranks."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    step_is_pad = batch.get("action_is_pad") if mask_steps else None
    dim_is_pad = batch.get(ACTION_DIM_PAD_KEY)
    if step_is_pad is None and dim_is_pad is None:
        return losses.mean() if reduction == "mean" else losses.mean(dim=(1, 2))
    valid = torch.ones((1, 1, 1), dtype=torch.bool, device=losses.device)
    if step_is_pad is not None:
        valid = valid & ~step_is_pad[:, :, None]
    if dim_is_pad is not None:
        valid = valid & ~dim_is_pad[:, None, :]
    losses = losses * valid
    count = valid.expand_as(losses)
    if reduction == "mean" and dim_is_pad is None:
        return losses.sum() / count.sum().clamp_min(1)
    per_sample = losses.sum(dim=(1, 2)) / count.sum(dim=(1, 2)).clamp_min(1)
    return per_sample if reduction == "none" else per_sample.mean()
