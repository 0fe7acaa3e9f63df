"""LeRobot 0.6.1's VLA fixtures (tests/fixtures/lerobot_0_6_1/{pi0_tiny,pi05_tiny,smolvla_tiny}, see its
PROVENANCE_vla.md): their files, the tiny sizes as lerobot_mg's ``dimension_overrides``, the stored inputs and
LeRobot's outputs, and a loadable copy of each pretrained_model/ for the tests that compare lerobot_mg with LeRobot.

The fixtures' own paths (``tokenizer_name``, ``vlm_model_name``) are relative to :data:`FIXTURES`; use
:func:`resolve_fixture_path` to turn them into real paths. Nothing here writes into the fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "lerobot_0_6_1"
VLA_FIXTURES = ("pi0_tiny", "pi05_tiny", "smolvla_tiny")
# PROVENANCE_vla.md's suggested tolerances (float32, one thread).
ATOL_TENSORS = 1e-5
ATOL_LOSSES = 1e-6


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def pretrained_model_dir(name: str) -> Path:
    return FIXTURES / name / "pretrained_model"


def resolve_fixture_path(path: str) -> Path:
    """A path written into a fixture (relative to the folder holding the fixtures) as a real path."""
    return FIXTURES / path


def config_json(name: str) -> dict[str, Any]:
    """The fixture's pretrained_model/config.json as LeRobot wrote it."""
    return json.loads((pretrained_model_dir(name) / "config.json").read_text())


def reference_json(name: str) -> dict[str, Any]:
    """reference.json: what each tensor is, the tiny overrides, the structure facts, the tolerances."""
    return json.loads((FIXTURES / name / "reference.json").read_text())


def reference(name: str) -> dict[str, torch.Tensor]:
    """The stored inputs (``input.*``, ``pre.*``) and LeRobot's outputs (``model.*``, ``train.*``, ``eval.*``,
    ``grad.*``, ``bf16.*``)."""
    return load_file(str(FIXTURES / name / "reference.safetensors"))


def manifest(name: str, build: str = "") -> dict[str, Any]:
    """state_dict_manifest.json (``build="bfloat16"``: the bfloat16 build's): ``keys`` in LeRobot's order (key,
    shape, dtype, kind, requires_grad, sha256), ``non_persistent_buffers``, the parameter counts."""
    suffix = f"_{build}" if build else ""
    return json.loads((FIXTURES / name / f"state_dict_manifest{suffix}.json").read_text())


def pi_dimension_overrides(name: str) -> dict[str, dict[str, int]]:
    """pi0_tiny's / pi05_tiny's tiny sizes (reference.json's ``tiny_overrides``) as ``policy.dimension_overrides``."""
    tiny = reference_json(name)["tiny_overrides"]
    overrides: dict[str, dict[str, int]] = {variant: dict(dims) for variant, dims in tiny["get_gemma_config"].items()}
    after = tiny["paligemma_config_after_lerobot"]
    overrides["vision"] = {key.removeprefix("vision_config."): int(value) for key, value in after.items()
                           if key.startswith("vision_config.")}
    overrides["text"] = {"vocab_size": int(after["text_config.vocab_size"])}
    return overrides


def preprocessed_batch(name: str, prefix: str = "pre") -> dict[str, torch.Tensor]:
    """The preprocessed batch LeRobot's policy received (``pre.*``, cameras as ``uint8.float() / 255``; their
    VISUAL normalisation is the identity) plus ``action_is_pad``."""
    tensors = reference(name)
    batch = {key.removeprefix(f"{prefix}."): value for key, value in tensors.items() if key.startswith(f"{prefix}.")}
    for key, value in tensors.items():
        if key.startswith("input.observation.images.") and key.endswith(".uint8"):
            batch[key.removeprefix("input.").removesuffix(".uint8")] = value.float() / 255
    batch["action_is_pad"] = tensors["input.action_is_pad"]
    return batch


def loadable_pretrained_copy(name: str, destination: Path, extra_policy_fields: dict[str, Any]) -> Path:
    """A copy of the fixture's pretrained_model/ whose train_config.json's ``policy`` section also holds
    ``extra_policy_fields`` (lerobot_mg-only fields such as the tiny ``dimension_overrides``, which LeRobot's
    config.json never holds). Returns the copy's path."""
    copy = destination / f"{name}_pretrained_model"
    shutil.copytree(pretrained_model_dir(name), copy)
    train_config_path = copy / "train_config.json"
    train_config = json.loads(train_config_path.read_text())
    train_config["policy"] = {**train_config.get("policy", {}), **extra_policy_fields}
    train_config_path.write_text(json.dumps(train_config, indent=4))
    return copy
