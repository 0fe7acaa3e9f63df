"""FSDP wrap-unit selection and the tied-weight check (lerobot_mg.distributed.wrap), on toy models and ACT."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from lerobot_mg.distributed.wrap import find_split_ties, select_wrap_units, size_rule_options
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.act import ACTConfig, ACTPolicy
from lerobot_mg.policies.diffusion import DiffusionConfig, DiffusionPolicy


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)  # 72 parameters at width 8


class Encoder(nn.Module):
    """Holds its blocks in a ModuleList: a container with no forward of its own."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))


class Toy(nn.Module):
    _fsdp_wrap_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.encoder = Encoder(num_blocks)
        self.head = nn.Linear(8, 2)  # 18 parameters


class Undeclared(Toy):
    _fsdp_wrap_modules: ClassVar[list[str]] = []


def _names(units: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in units]


def _tiny_act() -> ACTPolicy:
    config = ACTConfig(
        chunk_size=4,
        n_action_steps=4,
        dim_model=16,
        n_heads=2,
        dim_feedforward=32,
        n_encoder_layers=2,
        n_vae_encoder_layers=1,
    )
    return ACTPolicy(
        config,
        {"observation.state": {"type": "STATE", "shape": [2]}},
        {"action": {"type": "ACTION", "shape": [2]}},
    )


# --- select_wrap_units --------------------------------------------------------------------------------------


def test_declared_units_are_used_bottom_up() -> None:
    units, rule = select_wrap_units(Toy(num_blocks=2), wrap_modules=None, min_num_params=None)
    assert _names(units) == ["encoder.blocks.0", "encoder.blocks.1"]
    assert all(isinstance(module, Block) for _, module in units)
    assert rule == "Toy._fsdp_wrap_modules=['Block']"


def test_act_declares_its_encoder_and_decoder_layers() -> None:
    units, rule = select_wrap_units(_tiny_act(), wrap_modules=None, min_num_params=None)
    assert _names(units) == [
        "model.vae_encoder.layers.0",
        "model.encoder.layers.0",
        "model.encoder.layers.1",
        "model.decoder.layers.0",
    ]
    assert rule == "ACTPolicy._fsdp_wrap_modules=['ACTEncoderLayer', 'ACTDecoderLayer']"


def test_wrap_modules_overrides_the_declaration() -> None:
    units, rule = select_wrap_units(Toy(num_blocks=2), wrap_modules=["Encoder"], min_num_params=None)
    assert _names(units) == ["encoder"]
    assert rule == "accelerator.fsdp.wrap_modules=['Encoder']"
    # ... and wins over min_num_params too (validate() refuses the pair before this point).
    units, _ = select_wrap_units(Toy(num_blocks=2), wrap_modules=["Encoder"], min_num_params=10)
    assert _names(units) == ["encoder"]


def test_min_num_params_overrides_the_declaration() -> None:
    units, rule = select_wrap_units(Toy(num_blocks=2), wrap_modules=None, min_num_params=50)
    assert _names(units) == ["encoder.blocks.0.linear", "encoder.blocks.1.linear"]  # 72 > 50; head has 18
    assert rule == "accelerator.fsdp.min_num_params=50"


def test_size_policy_skips_a_module_list_above_the_threshold() -> None:
    """4 blocks of 72 parameters: each block is below 200 but their ModuleList (288) is above. fully_shard
    cannot wrap a container without forward, so the unit is the Encoder that owns the list."""
    model = Toy(num_blocks=4)
    assert sum(p.numel() for p in model.encoder.blocks.parameters()) == 288
    units, _ = select_wrap_units(model, wrap_modules=None, min_num_params=200)
    assert _names(units) == ["encoder"]
    assert not any(isinstance(module, nn.ModuleList) for _, module in units)


def test_size_policy_on_act_skips_its_layer_lists() -> None:
    """At 3000 the encoder layers (2224 each) stay below and their ModuleList (4448) passes: ACTEncoder is
    chosen instead of the list; the decoder layer (3344) passes by itself, and the ACT module keeps the 4162
    parameters left (VAE encoder, projections, embeddings)."""
    units, _ = select_wrap_units(_tiny_act(), wrap_modules=None, min_num_params=3000)
    assert _names(units) == ["model.decoder.layers.0", "model.encoder", "model"]


def test_size_policy_counts_only_parameters_no_smaller_unit_claimed() -> None:
    # Blocks (72 each) become units at 60; the Encoder above them then holds no unclaimed parameters.
    units, _ = select_wrap_units(Toy(num_blocks=3), wrap_modules=None, min_num_params=60)
    assert _names(units) == ["encoder.blocks.0.linear", "encoder.blocks.1.linear", "encoder.blocks.2.linear"]


def test_no_declaration_and_no_override_fails_with_thresholds_to_pick_from() -> None:
    with pytest.raises(ConfigError) as error:
        select_wrap_units(Undeclared(), wrap_modules=None, min_num_params=None)
    # 4 Linear(8, 8) of 72 parameters and a head of 18: at 38 the four linears are units, at 9 the head too.
    assert str(error.value) == (
        "accelerator.fsdp.wrap_modules=None and accelerator.fsdp.min_num_params=None: Undeclared declares no "
        "_fsdp_wrap_modules, so a sharded run would wrap only the root module and save no memory. Fix: "
        "accelerator.fsdp.min_num_params=38 gives 4 units, accelerator.fsdp.min_num_params=9 gives 5 units "
        "(of 306 parameters), or accelerator.fsdp.wrap_modules='[\"MyBlock\"]'"
    )
    # Either override makes the same model shardable, and the suggested thresholds give what they say.
    assert _names(select_wrap_units(Undeclared(), ["Block"], None)[0])[0] == "encoder.blocks.0"
    assert _names(select_wrap_units(Undeclared(), None, 50)[0])[0] == "encoder.blocks.0.linear"
    for threshold, num_units in size_rule_options(Undeclared()):
        assert len(select_wrap_units(Undeclared(), None, threshold)[0]) == num_units


def test_size_thresholds_for_the_default_diffusion_policy() -> None:
    """The suggestions a user of policy=diffusion sees on a sharded run without a unit rule (LeRobot's default
    U-Net, 248.6M parameters with a 14-dim state and action): distinct unit counts from a handful up."""
    with torch.device("meta"):  # sizes only: no 1 GB of weights to initialise
        policy = DiffusionPolicy(
            DiffusionConfig(),
            {"observation.state": {"type": "STATE", "shape": [14]}},
            {"action": {"type": "ACTION", "shape": [14]}},
        )
    assert sum(p.numel() for p in policy.parameters()) == 248_573_070
    # Half the size (120M) and a quarter (62M) leave one unit: the first suggestion is an eighth.
    assert size_rule_options(policy) == [(31_000_000, 5), (16_000_000, 9), (7_800_000, 14), (3_900_000, 19)]


def test_unknown_wrap_class_names_the_classes_that_exist() -> None:
    with pytest.raises(ConfigError) as error:
        select_wrap_units(Toy(), wrap_modules=["Block", "TransformerBlock"], min_num_params=None)
    message = str(error.value)
    assert message.startswith(
        "accelerator.fsdp.wrap_modules=['Block', 'TransformerBlock']: "
        "no module of class ['TransformerBlock'] in Toy, whose classes are ['Block', 'Encoder', 'Linear', "
        "'ModuleList']. Fix: accelerator.fsdp.wrap_modules=[<some of those classes>]"
    )


def test_threshold_above_every_submodule_fails_instead_of_wrapping_only_the_root() -> None:
    with pytest.raises(ConfigError) as error:
        select_wrap_units(Toy(num_blocks=2), wrap_modules=None, min_num_params=10_000)
    assert str(error.value).startswith(
        "accelerator.fsdp.min_num_params=10000 selects no submodule: only the root would be wrapped"
    )
    assert "Fix: a smaller accelerator.fsdp.min_num_params" in str(error.value)


# --- find_split_ties ----------------------------------------------------------------------------------------


def test_untied_model_has_no_split_ties() -> None:
    model = Toy(num_blocks=2)
    units, _ = select_wrap_units(model, None, None)
    assert find_split_ties(model, units) == []


def test_tie_between_two_units_is_named() -> None:
    model = Toy(num_blocks=2)
    model.encoder.blocks[1].linear.weight = model.encoder.blocks[0].linear.weight
    units, _ = select_wrap_units(model, None, None)
    assert find_split_ties(model, units) == [
        "encoder.blocks.0.linear.weight (unit encoder.blocks.0), "
        "encoder.blocks.1.linear.weight (unit encoder.blocks.1)"
    ]


def test_tie_between_the_root_and_a_unit_is_named() -> None:
    model = Toy(num_blocks=2)
    model.head = nn.Linear(8, 8)
    model.head.weight = model.encoder.blocks[1].linear.weight  # an output layer tied to a block
    units, _ = select_wrap_units(model, None, None)
    assert find_split_ties(model, units) == [
        "head.weight (unit <root>), encoder.blocks.1.linear.weight (unit encoder.blocks.1)"
    ]


def test_tie_kept_inside_one_unit_is_allowed() -> None:
    """The guide's fix: wrap a larger class so both users of the weight land in the same unit."""
    model = Toy(num_blocks=2)
    model.encoder.blocks[1].linear.weight = model.encoder.blocks[0].linear.weight
    units, _ = select_wrap_units(model, wrap_modules=["Encoder"], min_num_params=None)
    assert find_split_ties(model, units) == []
    # Both users in the root unit: also fine.
    root_tied = Toy(num_blocks=2)
    root_tied.extra = nn.Linear(8, 2)
    root_tied.extra.weight = root_tied.head.weight
    assert find_split_ties(root_tied, select_wrap_units(root_tied, None, None)[0]) == []


def test_tie_between_nested_units_is_named() -> None:
    """An inner unit inside an outer unit: the inner one owns its parameters, so a tie across them splits."""
    model = Toy(num_blocks=2)
    model.encoder.proj = nn.Linear(8, 8)
    model.encoder.proj.weight = model.encoder.blocks[0].linear.weight
    units, _ = select_wrap_units(model, wrap_modules=["Encoder", "Block"], min_num_params=None)
    assert _names(units) == ["encoder.blocks.0", "encoder.blocks.1", "encoder"]
    assert find_split_ties(model, units) == [
        "encoder.proj.weight (unit encoder), encoder.blocks.0.linear.weight (unit encoder.blocks.0)"
    ]
