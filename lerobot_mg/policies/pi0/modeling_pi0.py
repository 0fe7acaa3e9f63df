"""pi0 (Black et al. 2024, "pi0: A Vision-Language-Action Flow Model for General Robot Control") as LeRobot 0.6.1
builds it: same config fields, same state-dict names, order and dtypes, same numbers.

The prefix is the cameras (SigLIP tokens projected into PaliGemma's Gemma) and the tokenised task; the suffix is a
state token and one token per action of the chunk, each the noisy action mixed with the flow-matching time by an
MLP. The action expert attends jointly with the VLM in every layer (:mod:`lerobot_mg.policies.vla.gemma`) and its
output is projected to the velocity. Training: mean squared error between the predicted and the true velocity over
every chunk step (LeRobot's pi0 does not mask the steps past the episode end) and the action's own dims. Inference:
the prefix is run once into a key/value cache, then ``num_inference_steps`` Euler steps run the suffix against it.

The batch is the preprocessor's: normalised ``observation.state`` and ``action``, cameras in [0, 1],
``observation.language.tokens`` / ``.attention_mask``; the policy resizes the cameras with padding, maps them to
[-1, 1] and adds the configured empty cameras itself, as LeRobot's does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file
from torch import Tensor, nn

from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.base import (
    SAMPLE_SEED_KEY,
    WEIGHTS_NAME,
    FeatureSpec,
    PreTrainedPolicy,
    checkpoint_activations,
    load_state_dict_strictly,
)
from lerobot_mg.policies.saved_config import CONFIG_NAME
from lerobot_mg.policies.vla.common import (
    LANGUAGE_ATTENTION_MASK,
    LANGUAGE_TOKENS,
    attention_masks_4d,
    blank_empty_camera,
    euler_integrate,
    example_language,
    flow_matching_losses,
    flow_matching_pair,
    leading_ones,
    make_att_2d_masks,
    pad_vector,
    per_sample_noise_and_time,
    position_ids_from_pad_masks,
    reduce_action_losses,
    resize_with_pad_centered,
    sample_noise,
    sample_time_beta,
    sinusoidal_time_embedding,
    zero_padded_action_dims,
)
from lerobot_mg.policies.vla.joint import KeyValue
from lerobot_mg.policies.vla.paligemma import SIGLIP_LAYER_CLASS, PaliGemmaWithExpertModel

OBS_STATE = "observation.state"
OBS_IMAGES = "observation.images"
ACTION = "action"

# (time (B,), x_t, v_t) at every Euler step, for callers that want to see the denoising.
StepObserver = Callable[[Tensor, Tensor, Tensor], None]


class PI0Pytorch(nn.Module):
    """The network: ``paligemma_with_expert`` and pi0's projections (``state_proj``, ``action_in_proj``,
    ``action_time_mlp_*``, ``action_out_proj``), created after the bfloat16 cast so they stay float32."""

    # pi0.5 sets it: the expert's norms are conditioned on the time (AdaRMS) and the suffix has no state token.
    expert_adarms: ClassVar[bool] = False

    def __init__(self, config: PI0Config) -> None:
        super().__init__()
        self.config = config
        expert = config.expert_dims
        self.paligemma_with_expert = PaliGemmaWithExpertModel(
            config.vlm_dims, expert, config.vision_dims, image_size=int(config.image_resolution[0]),
            vocab_size=config.vocab_size, expert_adarms=self.expert_adarms, dtype=config.dtype,
            freeze_vision_encoder=config.freeze_vision_encoder, train_expert_only=config.train_expert_only,
        )
        self.action_in_proj = nn.Linear(config.max_action_dim, expert.width)
        self.action_out_proj = nn.Linear(expert.width, config.max_action_dim)
        self._build_time_projections(expert.width)

    def _build_time_projections(self, width: int) -> None:
        self.state_proj = nn.Linear(self.config.max_state_dim, width)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)

    # --- draws ---

    def sample_noise(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        return sample_noise(shape, device)

    def sample_time(self, batch_size: int, device: torch.device) -> Tensor:
        config = self.config
        return sample_time_beta(batch_size, device, alpha=config.time_sampling_beta_alpha,
                                beta=config.time_sampling_beta_beta, scale=config.time_sampling_scale,
                                offset=config.time_sampling_offset)

    # --- embeddings ---

    def embed_prefix(self, images: list[Tensor], img_masks: list[Tensor], tokens: Tensor, masks: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """(embeddings (B, P, W), pad masks (B, P), autoregressive masks (B, P)): the image tokens of every
        camera, then the language tokens; the whole prefix attends to itself."""
        embs, pad_masks = [], []
        for image, image_mask in zip(images, img_masks, strict=True):
            image_emb = self.paligemma_with_expert.embed_image(image)
            batch_size, num_tokens = image_emb.shape[:2]
            embs.append(image_emb)
            pad_masks.append(image_mask[:, None].expand(batch_size, num_tokens))
        embs.append(self.paligemma_with_expert.embed_language_tokens(tokens))
        pad_masks.append(masks)
        embs_cat = torch.cat(embs, dim=1)
        pad_cat = torch.cat(pad_masks, dim=1)
        att_masks = torch.zeros(pad_cat.shape, dtype=torch.bool, device=pad_cat.device)
        return embs_cat, pad_cat, att_masks

    def _time_embedding(self, timestep: Tensor) -> Tensor:
        return sinusoidal_time_embedding(timestep, self.action_in_proj.out_features, self.config.min_period,
                                         self.config.max_period).type(dtype=timestep.dtype)

    def _action_att_masks(self, batch_size: int, leading: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """(B, leading + chunk) autoregressive masks of ``leading`` tokens that each start a block (pi0's state
        token) then the actions: the first action token starts a new block, so the prefix (and the state token)
        never attend to the actions, and the actions attend to each other and to everything before."""
        return leading_ones(batch_size, leading + self.config.chunk_size, leading + 1, dtype, device)

    def embed_suffix(self, state: Tensor | None, noisy_actions: Tensor, timestep: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(embeddings (B, 1 + chunk, W), pad masks, autoregressive masks (float), AdaRMS condition (None)): the
        state token, then each noisy action mixed with the time embedding by the action-time MLP."""
        if state is None:
            raise ValueError("pi0 needs the observation.state")
        if self.state_proj.weight.dtype == torch.float32:
            state = state.to(torch.float32)
        state_emb = self.state_proj(state)
        batch_size = state_emb.shape[0]
        action_emb = self.action_in_proj(noisy_actions)
        time_emb = self._time_embedding(timestep)[:, None, :].expand_as(action_emb)
        action_time = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([action_emb, time_emb],
                                                                                         dim=2))))
        embs = torch.cat([state_emb[:, None, :], action_time], dim=1)
        pad_masks = torch.ones(batch_size, embs.shape[1], dtype=torch.bool, device=timestep.device)
        att_masks = self._action_att_masks(batch_size, 1, embs.dtype, embs.device)
        return embs, pad_masks, att_masks, None

    # --- passes ---

    def forward(self, images: list[Tensor], img_masks: list[Tensor], tokens: Tensor, masks: Tensor,
                state: Tensor | None, actions: Tensor, noise: Tensor, time: Tensor) -> Tensor:
        """(B, chunk, max_action_dim) elementwise squared error of the velocity at times ``time`` with ``noise``."""
        x_t, u_t = flow_matching_pair(actions, noise, time)
        prefix_embs, prefix_pad, prefix_att = self.embed_prefix(images, img_masks, tokens, masks)
        suffix_embs, suffix_pad, suffix_att, cond = self.embed_suffix(state, x_t, time)
        pad_masks = torch.cat([prefix_pad, suffix_pad], dim=1)
        att_masks = torch.cat([prefix_att, suffix_att], dim=1)
        mask_4d = attention_masks_4d(make_att_2d_masks(pad_masks, att_masks))
        _, suffix_out, _ = self.paligemma_with_expert(prefix_embs, suffix_embs, mask_4d,
                                                      position_ids_from_pad_masks(pad_masks), expert_cond=cond)
        v_t = self.action_out_proj(suffix_out[:, -self.config.chunk_size:].to(dtype=torch.float32))
        return flow_matching_losses(u_t, v_t)

    @torch.no_grad()
    def sample_actions(self, images: list[Tensor], img_masks: list[Tensor], tokens: Tensor, masks: Tensor,
                       state: Tensor | None, noise: Tensor | None = None, num_steps: int | None = None,
                       on_step: StepObserver | None = None) -> Tensor:
        """(B, chunk, max_action_dim) actions: the prefix once into the cache, then Euler from ``noise``."""
        num_steps = self.config.num_inference_steps if num_steps is None else num_steps
        if noise is None:
            noise = self.sample_noise((tokens.shape[0], self.config.chunk_size, self.config.max_action_dim),
                                      tokens.device)
        prefix_embs, prefix_pad, prefix_att = self.embed_prefix(images, img_masks, tokens, masks)
        mask_4d = attention_masks_4d(make_att_2d_masks(prefix_pad, prefix_att))
        _, _, cache = self.paligemma_with_expert(prefix_embs, None, mask_4d, position_ids_from_pad_masks(prefix_pad),
                                                  fill_cache=True)
        assert cache is not None  # the prefix pass always fills it

        def velocity(x_t: Tensor, timestep: Tensor) -> Tensor:
            return self.denoise_step(state, prefix_pad, cache, x_t, timestep)

        return euler_integrate(velocity, noise, num_steps, on_step)

    def denoise_step(self, state: Tensor | None, prefix_pad_masks: Tensor, cache: list[KeyValue], x_t: Tensor,
                     timestep: Tensor) -> Tensor:
        """The velocity at ``x_t``: the suffix against the cached prefix."""
        suffix_embs, suffix_pad, suffix_att, cond = self.embed_suffix(state, x_t, timestep)
        batch_size, suffix_len = suffix_pad.shape
        prefix_len = prefix_pad_masks.shape[1]
        prefix_2d = prefix_pad_masks[:, None, :].expand(batch_size, suffix_len, prefix_len)
        full_2d = torch.cat([prefix_2d, make_att_2d_masks(suffix_pad, suffix_att)], dim=2)
        position_ids = position_ids_from_pad_masks(suffix_pad, torch.sum(prefix_pad_masks, dim=-1)[:, None])
        _, suffix_out, _ = self.paligemma_with_expert(None, suffix_embs, attention_masks_4d(full_2d), position_ids,
                                                      cache=cache, expert_cond=cond)
        return self.action_out_proj(suffix_out[:, -self.config.chunk_size:].to(dtype=torch.float32))


class PI0Policy(PreTrainedPolicy):
    """LeRobot's ``PI0Policy``: state dict ``model.paligemma_with_expert.*``, ``model.action_in_proj.*``, ...

    ``forward(batch, noise=None, time=None, reduction="mean")`` takes explicit flow-matching draws (tests, exact
    comparisons); without them each sample draws its own from its ``sample_seed`` (the same on every data-parallel
    layout), or from the global RNG when the batch has no seeds. ``from_pretrained`` is strict: weights that do not
    fit the config are a ConfigError naming the keys, never a random initialisation."""

    name: ClassVar[str] = "pi0"
    config_class: ClassVar[type] = PI0Config
    model_class: ClassVar[type[PI0Pytorch]] = PI0Pytorch
    # The vision tower's layers are FSDP units; the joint layers are declared by fsdp_unit_groups().
    _fsdp_wrap_modules: ClassVar[list[str]] = [SIGLIP_LAYER_CLASS]
    # Activation checkpointing recomputes each joint layer (the VLM layer's forward runs the expert's inside).
    _checkpoint_modules: ClassVar[list[str]] = ["VLMDecoderLayer"]
    # LeRobot 0.6.1's default LoRA targets: the expert's q/v projections and the action/state/time projections
    # (pi0.5 has no state_proj, and its time MLP is named time_mlp_*: only the action projections match there).
    _peft_target_modules: ClassVar[str] = (r"(.*\.gemma_expert\..*\.self_attn\.(q|v)_proj|model\.(state_proj"
                                           r"|action_in_proj|action_out_proj|action_time_mlp_in|action_time_mlp_out))")
    # The state enters the suffix as a token (pi0.5 puts it in the prompt instead).
    reads_state: ClassVar[bool] = True

    def __init__(self, config: PI0Config, input_features: dict[str, FeatureSpec],
                 output_features: dict[str, FeatureSpec], *, load_backbone_weights: bool = True) -> None:
        # load_backbone_weights: nothing is downloaded at build time (a base comes with policy.path).
        input_features = dict(input_features)
        for index in range(config.empty_cameras):
            input_features.setdefault(f"{OBS_IMAGES}.empty_camera_{index}",
                                      {"type": "VISUAL", "shape": [3, *config.image_resolution]})
        super().__init__(config, input_features, output_features)
        self.config: PI0Config = config
        if ACTION not in output_features or len(output_features[ACTION]["shape"]) != 1:
            raise ConfigError(f"output_features={output_features}: {self.name} needs a 1-D 'action' output feature. "
                              "Fix: a dataset (dataset.root) whose 'action' feature is 1-D")
        self.action_dim = int(output_features[ACTION]["shape"][0])
        self.image_keys = [key for key, spec in self.input_features.items() if spec["type"] == "VISUAL"]
        if not self.image_keys:
            raise ConfigError(f"input_features={sorted(input_features)}: {self.name} reads at least one camera. Fix: "
                              "a dataset with a camera (dataset.root), or policy.empty_cameras=1")
        self.model = self.model_class(config)
        if config.gradient_checkpointing:
            for vlm_layer, _ in self.fsdp_unit_groups():
                checkpoint_activations(vlm_layer)

    def example_batch(self, batch_size: int) -> dict[str, Tensor]:
        """The base's zeros plus a prompt of tokenizer_max_length tokens (the longest the processor makes) and each
        sample's seed, on the host whatever the default device (the training noise is drawn there from it)."""
        return {**super().example_batch(batch_size), **example_language(batch_size, self.config.tokenizer_max_length),
                SAMPLE_SEED_KEY: torch.arange(batch_size, device="cpu")}

    def fsdp_unit_groups(self) -> list[tuple[nn.Module, ...]]:
        """[(VLM layer i, expert layer i)]: each joint layer is one FSDP2 unit (gathered and resharded together)."""
        return list(self.model.paligemma_with_expert.joint_layers())

    def unused_parameter_names(self) -> list[str]:
        """The parameters a training step never gives a gradient (their ``.grad`` stays None), as in LeRobot: both
        language heads (kept in the state dict for LeRobot, never computed), and the output side of the last VLM
        layer and the VLM's final norm (the prefix's last hidden state is discarded; only its keys and values reach
        the expert). The run freezes them, which changes no number: LeRobot's AdamW skips a parameter without a
        gradient (no update, no weight decay). The last VLM layer's q_proj is not listed: its gradient exists and
        is exactly zero, and weight decay still applies to it, as in LeRobot."""
        pwe = self.model.paligemma_with_expert
        last = pwe.vlm.layers[-1]
        modules = [pwe.paligemma.lm_head, pwe.gemma_expert.lm_head, pwe.vlm.norm, last.self_attn.o_proj,
                   last.post_attention_layernorm, last.mlp]
        ids = {id(param) for module in modules for param in module.parameters()}
        return [name for name, param in self.named_parameters() if id(param) in ids]

    # --- inputs ---

    def preprocess_images(self, batch: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """The cameras as the VLM reads them: each present camera resized with padding to image_resolution and
        mapped from [0, 1] to [-1, 1] (mask True, or all -1 and mask False in the samples whose
        ``empty_camera_key(camera)`` is True), then the absent ones (the empty cameras) all -1 (mask False)."""
        present = [key for key in self.image_keys if key in batch]
        missing = [key for key in self.image_keys if key not in batch]
        if not present:
            raise ValueError(f"The {self.name} policy's batch holds none of its cameras {self.image_keys}; it has "
                             f"{sorted(batch)}.")
        device = self.model.action_in_proj.weight.device  # one parameter (next(parameters()) walks modules)
        resolution = tuple(int(size) for size in self.config.image_resolution)
        images, masks = [], []
        for key in present:
            image = batch[key].to(device=device, dtype=torch.float32)
            channels_first = image.shape[1] == 3
            if channels_first:
                image = image.permute(0, 2, 3, 1)
            if tuple(image.shape[1:3]) != resolution:
                image = resize_with_pad_centered(image, *resolution)
            image = image * 2.0 - 1.0
            if channels_first:
                image = image.permute(0, 3, 1, 2)
            image, mask = blank_empty_camera(batch, key, image,
                                             torch.ones(image.shape[0], dtype=torch.bool, device=device))
            images.append(image)
            masks.append(mask)
        for _ in missing:
            images.append(torch.ones_like(images[-1]) * -1)
            masks.append(torch.zeros_like(masks[-1]))
        return images, masks

    def _language(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        missing = [key for key in (LANGUAGE_TOKENS, LANGUAGE_ATTENTION_MASK) if key not in batch]
        if missing:
            raise ValueError(f"The {self.name} policy's batch lacks {missing} (the preprocessor's tokenizer step "
                             f"writes them); it has {sorted(batch)}.")
        return batch[LANGUAGE_TOKENS], batch[LANGUAGE_ATTENTION_MASK]

    def prepare_state(self, batch: dict[str, Tensor]) -> Tensor | None:
        if not self.reads_state:
            return None
        if OBS_STATE not in batch:
            raise ValueError(f"The {self.name} policy's batch lacks {OBS_STATE!r}; it has {sorted(batch)}.")
        return pad_vector(batch[OBS_STATE], self.config.max_state_dim)

    def prepare_action(self, batch: dict[str, Tensor]) -> Tensor:
        if ACTION not in batch:
            raise ValueError(f"The {self.name} policy's batch lacks 'action'; it has {sorted(batch)}.")
        actions = batch[ACTION]
        if actions.shape[1] != self.config.chunk_size:
            raise ValueError(f"The batch's action chunk has {actions.shape[1]} steps but policy.chunk_size="
                             f"{self.config.chunk_size}; load actions at policy.action_delta_indices.")
        return pad_vector(zero_padded_action_dims(batch, actions), self.config.max_action_dim)

    def training_draws(self, batch: dict[str, Tensor], shape: tuple[int, ...], device: torch.device
                       ) -> tuple[Tensor, Tensor]:
        """(noise, time) for a training batch: each sample's from its own seed when the batch has them (noise
        first, then time, on the host), else from the global RNG in LeRobot's order (noise, then time)."""
        seeds = batch.get(SAMPLE_SEED_KEY)
        if seeds is None:
            return self.model.sample_noise(shape, device), self.model.sample_time(shape[0], device)
        config = self.config
        return per_sample_noise_and_time(seeds.tolist(), shape[1:], device, alpha=config.time_sampling_beta_alpha,
                                         beta=config.time_sampling_beta_beta, scale=config.time_sampling_scale,
                                         offset=config.time_sampling_offset)

    # --- training and inference ---

    def elementwise_losses(self, batch: dict[str, Tensor], noise: Tensor | None = None, time: Tensor | None = None
                           ) -> Tensor:
        """(B, chunk, action_dim) squared velocity errors (the dims past the action feature dropped; a dataset
        mixture's padded dims, ``ACTION_DIM_PAD_KEY``, are kept: :meth:`forward` leaves them out)."""
        images, img_masks = self.preprocess_images(batch)
        tokens, masks = self._language(batch)
        state = self.prepare_state(batch)
        actions = self.prepare_action(batch)
        if noise is None or time is None:
            drawn_noise, drawn_time = self.training_draws(batch, tuple(actions.shape), actions.device)
            noise = drawn_noise if noise is None else noise
            time = drawn_time if time is None else time
        losses = self.model(images, img_masks, tokens, masks, state, actions, noise, time)
        return losses[:, :, : self.action_dim]

    def forward(self, batch: dict[str, Tensor], noise: Tensor | None = None, time: Tensor | None = None,
                reduction: str = "mean") -> tuple[Tensor, dict[str, float]]:
        """LeRobot's loss: the mean over the batch, every chunk step (``action_is_pad`` is not read, as in LeRobot)
        and the action's dims; a dataset mixture's batch (``ACTION_DIM_PAD_KEY``) is the mean of each sample's mean
        over its real dims (see :func:`reduce_action_losses`); ``reduction="none"`` gives one loss per sample (B,)."""
        losses = self.elementwise_losses(batch, noise, time)
        return reduce_action_losses(batch, losses, reduction, mask_steps=False), {}

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor], noise: Tensor | None = None,
                             on_step: StepObserver | None = None) -> Tensor:
        """(B, chunk_size, action_dim) normalised actions; ``noise`` (B, chunk_size, max_action_dim) is the
        starting point (drawn from the global RNG when None)."""
        images, img_masks = self.preprocess_images(batch)
        tokens, masks = self._language(batch)
        actions = self.model.sample_actions(images, img_masks, tokens, masks, self.prepare_state(batch), noise,
                                            on_step=on_step)
        return actions[:, :, : self.action_dim]

    # --- weights ---

    def load_weights(self, directory: Path, map_location: str | torch.device = "cpu") -> None:
        """Load ``directory``'s model.safetensors strictly into the parameters as built (their dtypes follow
        ``policy.dtype``; stored tensors are cast to them, as LeRobot loads). Keys without the ``model.`` prefix
        (openpi's layout) get it."""
        directory = Path(directory)
        weights_path = directory / WEIGHTS_NAME
        if not weights_path.is_file():
            raise ConfigError(
                f"{directory}: holds no {WEIGHTS_NAME} (a checkpoint saved with checkpoint.format=dcp holds only "
                f"DCP shards, pytorch_model_fsdp_0/). Fix: merge them first with lerobot-mg-convert-dcp "
                f"checkpoint_dir={directory}")
        stored = load_file(str(weights_path), device=str(map_location))
        state_dict = {key if key.startswith("model.") else f"model.{key}": value for key, value in stored.items()}
        load_state_dict_strictly(self, state_dict, str(weights_path), str(directory / CONFIG_NAME))
