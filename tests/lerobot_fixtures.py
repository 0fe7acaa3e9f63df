"""LeRobot 0.6.1's interop fixtures (tests/fixtures/lerobot_0_6_1, see its PROVENANCE.md): their files, the
weights recipe that rebuilds the image models' model.safetensors, and the stored inputs, for every test that
compares lerobot_mg with LeRobot."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "lerobot_0_6_1"
EPS = 1e-8  # LeRobot's normalizer eps: (x - mean) / (std + eps)
# The recipe's torch.randn takes its Box-Muller logarithms and cosines from Sleef's vectorised kernels where ATen runs
# with AVX2 or newer (LeRobot's machine, and the digests below), from libm where it runs its scalar kernels (DEFAULT:
# a CPU without AVX2): there the draws part by float32 ulps (371 of 1,000, at most 1.2e-6), so the recipe's digests
# can only match on the former. The comparisons of outputs, with their tolerances, hold on either (tests/README.md).
RECIPE_IS_BIT_EXACT = torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def pretrained_model_dir(name: str) -> Path:
    return FIXTURES / name / "pretrained_model"


def config_json(name: str) -> dict[str, Any]:
    """The fixture's pretrained_model/config.json as LeRobot wrote it."""
    return json.loads((pretrained_model_dir(name) / "config.json").read_text())


def manifest(name: str) -> list[dict[str, Any]]:
    """Every state_dict key in LeRobot's order: key, shape, dtype, kind, sha256 (and init for image models)."""
    return json.loads((FIXTURES / name / "state_dict_manifest.json").read_text())["keys"]


def reference(name: str) -> dict[str, torch.Tensor]:
    """The stored inputs (``input.*``, ``pre.*``) and LeRobot's outputs (``eval.*``, ``train.*``, ...)."""
    return load_file(str(FIXTURES / name / "reference.safetensors"))


def sha256_of(tensor: torch.Tensor) -> str:
    """The manifest's digest: raw little-endian bytes of ``tensor.contiguous().numpy()``."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _recipe_value(key: str, shape: list[int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if key.endswith("running_var"):
        return torch.rand(shape, generator=generator) + 0.5
    if key.endswith("num_batches_tracked"):
        return torch.zeros(shape, dtype=torch.int64)
    if key.endswith(".weight") and len(shape) == 1:
        return 1 + 0.1 * torch.randn(shape, generator=generator)
    return 0.02 * torch.randn(shape, generator=generator)


def fixture_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The fixture policy's state_dict in manifest order: act_state's stored model.safetensors; for the image
    models the PROVENANCE.md "Weights" recipe (constant_buffers.safetensors, else one generator per key seeded by
    crc32(key)). Every tensor's sha256 is checked against the manifest (the recipe's where torch.randn can give
    LeRobot's bits, ``RECIPE_IS_BIT_EXACT``)."""
    stored = pretrained_model_dir(name) / "model.safetensors"
    constants: dict[str, torch.Tensor] = {}
    if stored.is_file():
        weights = load_file(str(stored))
    else:
        constants = load_file(str(FIXTURES / name / "constant_buffers.safetensors"))
        weights = {}
        for entry in manifest(name):
            key = entry["key"]
            weights[key] = constants[key] if key in constants else _recipe_value(key, entry["shape"])
    rebuilt = {}
    for entry in manifest(name):
        tensor = weights[entry["key"]]
        assert list(tensor.shape) == entry["shape"], entry["key"]
        if stored.is_file() or entry["key"] in constants or RECIPE_IS_BIT_EXACT:
            assert sha256_of(tensor) == entry["sha256"], f"{entry['key']}: sha256 differs from the manifest"
        rebuilt[entry["key"]] = tensor
    assert weights.keys() == rebuilt.keys()
    return rebuilt


def normalizer_stats(name: str) -> dict[str, torch.Tensor]:
    """The preprocessor's normalizer state (flat ``<feature>.<stat>``), camera mean/std ImageNet's."""
    return load_file(str(pretrained_model_dir(name) / "policy_preprocessor_step_3_normalizer_processor.safetensors"))


def normalized_camera(name: str, camera: str) -> torch.Tensor:
    """The stored uint8 frames as the preprocessor hands them to the policy: /255, then MEAN_STD with the
    normalizer file's (ImageNet) statistics."""
    frames = reference(name)[f"input.{camera}.uint8"].float() / 255
    stats = normalizer_stats(name)
    return (frames - stats[f"{camera}.mean"]) / (stats[f"{camera}.std"] + EPS)


def chunk_with_encoder_io(policy: torch.nn.Module, act: torch.nn.Module,
                          batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy.predict_action_chunk`` on the batch's observations, with what ``act``'s transformer encoder saw
    and gave (``tokens``, ``pos_embed``, ``out``), hooked: the fixtures store all three."""
    seen: dict[str, torch.Tensor] = {}

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.update(tokens=args[0], pos_embed=args[1], out=output)

    handle = act.model.encoder.register_forward_hook(hook)
    try:
        chunk = policy.predict_action_chunk({k: v for k, v in batch.items() if not k.startswith("action")})
    finally:
        handle.remove()
    return chunk, seen
