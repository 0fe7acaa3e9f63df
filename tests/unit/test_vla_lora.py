"""LoRA targets of the vision-language-action policies: LeRobot 0.6.1 declares them as one regular expression (a
string that peft full-matches against each module name), not as a list of names.

The policies are LeRobot's own tiny fixtures (tests/fixtures/lerobot_0_6_1, PROVENANCE_vla.md), loaded by our code;
their module names are checked against the regex by peft itself (get_peft_model), on the meta device where only
names matter.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lerobot_mg.config.schema import PeftConfig
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.lora import check_peft_config, resolve_targets, wrap_with_lora
from lerobot_mg.policies.base import PreTrainedPolicy
from lerobot_mg.policies.pi0.modeling_pi0 import PI0Policy
from lerobot_mg.policies.pi05.modeling_pi05 import PI05Policy
from lerobot_mg.policies.smolvla.modeling_smolvla import SmolVLAPolicy
from tests import vla_fixtures as vf

# LeRobot 0.6.1's defaults (_get_default_peft_targets): pi0 and pi0.5 (modeling_pi0.py:1134, modeling_pi05.py:1098)
# adapt the action expert's query and value projections and the action/state/time projections.
LEROBOT_PI_TARGETS = (r"(.*\.gemma_expert\..*\.self_attn\.(q|v)_proj|model\.(state_proj|action_in_proj|action_out_proj"
                      r"|action_time_mlp_in|action_time_mlp_out))")
PI0_PROJECTIONS = ("action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out", "state_proj")
PI05_PROJECTIONS = ("action_in_proj", "action_out_proj")


@contextmanager
def in_fixtures() -> Iterator[None]:
    """The fixtures' paths (SmolVLA's vlm_model_name) are relative to the folder holding them."""
    before = Path.cwd()
    os.chdir(vf.FIXTURES)
    try:
        yield
    finally:
        os.chdir(before)


def _config(name: str, tmp_path: Path) -> tuple[PreTrainedPolicy, SimpleNamespace]:
    """(a meta-device policy of the fixture ``name``, the run config check_peft_config reads, base = the fixture)."""
    policy_class = {"pi0_tiny": PI0Policy, "pi05_tiny": PI05Policy, "smolvla_tiny": SmolVLAPolicy}[name]
    if name == "smolvla_tiny":
        base = vf.pretrained_model_dir(name)
    else:  # the tiny sizes are lerobot_mg-only fields, read from train_config.json
        base = vf.loadable_pretrained_copy(name, tmp_path, {"dimension_overrides": vf.pi_dimension_overrides(name)})
    policy_cfg, inputs, outputs = policy_class.read_config(base)
    policy_cfg.path = str(base)
    with torch.device("meta"):
        policy = policy_class(policy_cfg, inputs, outputs)
    cfg = SimpleNamespace(peft=PeftConfig(method_type="LORA", r=2), policy=policy_cfg,
                          accelerator=SimpleNamespace(fsdp=SimpleNamespace(ignored_modules=None)))
    return policy, cfg


def _adapted(policy: PreTrainedPolicy, cfg: SimpleNamespace) -> list[str]:
    """The modules peft gave a LoRA adapter, by the policy's own names."""
    model = wrap_with_lora(policy, cfg.peft, cfg.policy.path)
    return sorted({name.removeprefix("base_model.model.").split(".lora_A")[0]
                   for name, _ in model.named_parameters() if ".lora_A." in name})


def test_smolvlas_default_regex_reaches_peft_unchanged(tmp_path: Path) -> None:
    with in_fixtures():
        policy, cfg = _config("smolvla_tiny", tmp_path)
        targets = resolve_targets(cfg.peft, SmolVLAPolicy)
        assert targets == SmolVLAPolicy._peft_target_modules and isinstance(targets, str)
        check_peft_config(cfg, sharded=True)
        adapted = _adapted(policy, cfg)
    layers = policy.config.num_vlm_layers
    assert adapted == sorted([*(f"model.vlm_with_expert.lm_expert.layers.{i}.self_attn.{p}_proj"
                                for i in range(layers) for p in "qv"), *(f"model.{p}" for p in PI0_PROJECTIONS)])
    assert policy.peft_config["default"].target_modules == SmolVLAPolicy._peft_target_modules  # not split up


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_pi0_takes_lerobots_default_targets(name: str, tmp_path: Path) -> None:
    assert PI0Policy._peft_target_modules == LEROBOT_PI_TARGETS
    policy, cfg = _config(name, tmp_path)
    check_peft_config(cfg, sharded=True)
    adapted = _adapted(policy, cfg)
    depth = policy.config.expert_dims.depth
    expert = [f"model.paligemma_with_expert.gemma_expert.model.layers.{i}.self_attn.{p}_proj"
              for i in range(depth) for p in "qv"]
    # pi0.5 has no state_proj and names its time MLP time_mlp_in/out: LeRobot's regex adapts its action projections
    projections = [f"model.{p}" for p in (PI0_PROJECTIONS if name == "pi0_tiny" else PI05_PROJECTIONS)]
    assert adapted == sorted(expert + projections)
    assert not any("language_model" in name or "vision" in name for name in adapted)  # the VLM stays as it was


@pytest.mark.parametrize(("pattern", "problem", "peft_adapts_nothing"), [
    (r"model\.nothing\..*", r"as a regular expression it matches no whole module name of SmolVLAPolicy", True),
    # re.search would find it; peft (like this check) matches the whole name, so it adapts nothing
    (r"lm_expert\..*\.q_proj", r"as a regular expression it matches no whole module name of SmolVLAPolicy", True),
    (r"model\.(q_proj", r"is not a regular expression \(missing \), unterminated subpattern", False),
    (r"model\.vlm_with_expert\.lm_expert\.layers\.0\.self_attn", r"matches model\.vlm_with_expert\.lm_expert\.layers\.0"
     r"\.self_attn, a .*; LoRA adapts Linear, Conv and Embedding layers", False),
])
def test_a_regex_peft_would_not_apply_is_refused(pattern: str, problem: str, peft_adapts_nothing: bool,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SmolVLAPolicy, "_peft_target_modules", pattern)
    with in_fixtures():
        policy, cfg = _config("smolvla_tiny", tmp_path)
        with pytest.raises(ConfigError) as error:
            check_peft_config(cfg, sharded=False)
    message = str(error.value)
    assert message.startswith(f"peft.target_modules={pattern!r}: ") and "\n" not in message
    assert re.search(problem, message), message
    assert "Fix: " in message
    if peft_adapts_nothing:  # what the check stands for: peft itself would find no target
        with pytest.raises(ValueError, match="not found in the base model"):
            get_peft_model(policy, LoraConfig(r=2, target_modules=pattern))


@pytest.mark.parametrize("pattern", [r".*\.lora_[AB]", r".*\.vlm_with_expert\.vlm"], ids=["lora", "frozen_vlm"])
def test_ignored_modules_are_matched_against_the_peft_models_names(pattern: str, tmp_path: Path) -> None:
    with in_fixtures():
        _, cfg = _config("smolvla_tiny", tmp_path)
        cfg.accelerator.fsdp.ignored_modules = pattern
        check_peft_config(cfg, sharded=True)  # accepted: it names modules of the wrapped model
        unprefixed = pattern.removeprefix(".*\\.")
        cfg.accelerator.fsdp.ignored_modules = unprefixed  # the policy's own names never match: they are prefixed
        with pytest.raises(ConfigError, match=r"matches no module of the PEFT model, whose module names begin with "
                                              r"'base_model.model.' .* Fix: begin the pattern with '.\*'"):
            check_peft_config(cfg, sharded=True)
