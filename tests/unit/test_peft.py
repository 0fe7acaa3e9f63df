"""Fine-tuning pieces in one process: policy.path, the peft.* checks, LoRA wrapping, dtypes and adapter files.

The distributed behaviour (FSDP2 / HSDP runs, checkpoints, resume, the converter) is in tests/dist/test_peft_runs.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lerobot_mg.config.loading import to_train_config
from lerobot_mg.config.schema import PeftConfig
from lerobot_mg.distributed.wrap import select_wrap_units
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import BASE_SHA256_KEY, adapter_base_path, apply_policy_path, weights_sha256
from lerobot_mg.peft.build import load_base_policy
from lerobot_mg.peft.lora import AdapterWeights, load_policy, wrap_with_lora
from lerobot_mg.policies.act import ACTPolicy
from lerobot_mg.preflight import preflight
from tests.tolerances import FLOAT32_ULPS, assert_close
from tests.unit.test_config import VALID, _compose, _train_config, _validation_error

FEATURES_IN = {"observation.state": {"type": "STATE", "shape": [2]}}  # the PushT slice's
FEATURES_OUT = {"action": {"type": "ACTION", "shape": [2]}}


def _save_base(directory: Path, **changes: object) -> Path:
    """A pretrained_model/ directory holding the pusht_debug ACT (with ``changes``), seeded."""
    config = _train_config(VALID).policy
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    ACTPolicy(config, FEATURES_IN, FEATURES_OUT).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_base(tmp_path_factory.mktemp("base") / "pretrained_model")


@pytest.fixture(scope="module")
def bf16_base_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = shutil.copytree(base_dir, tmp_path_factory.mktemp("bf16") / "pretrained_model")
    weights = load_file(str(directory / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def _lora(base: Path, *extra: str) -> list[str]:
    return [*VALID, f"policy.path={base}", "peft=lora", "peft.r=4", *extra]


def test_policy_path_takes_the_base_config_and_keeps_command_line_overrides(tmp_path: Path) -> None:
    base = _save_base(tmp_path / "pretrained_model", dim_feedforward=96, kl_weight=3.0)
    overrides = [*VALID, f"policy.path={base}", "policy.kl_weight=0.5"]
    composed = apply_policy_path(_compose(overrides), overrides)
    policy = to_train_config(composed).policy
    assert (policy.dim_feedforward, policy.kl_weight, policy.path) == (96, 0.5, str(base))
    assert load_base_policy(policy, str(base)).model.encoder.layers[0].linear1.out_features == 96


def test_lora_configs_validate(base_dir: Path) -> None:
    preflight(_train_config(_lora(base_dir, "peft.full_training_modules=[action_head]")), 1)
    # A pattern that begins with .* matches the PEFT model's names.
    preflight(_train_config(_lora(base_dir, "parallelism.dp_shard=2",
                                 "accelerator.fsdp.ignored_modules=.*model.action_head")), 2)


@pytest.mark.parametrize(("extra", "world_size", "message"), [
    (["peft.target_modules=[linear3]"], 1,
     r"^peft.target_modules=\['linear3'\]: 'linear3' names no module of ACTPolicy. Fix: choose among its adaptable "
     r"modules \[.*'linear1', 'linear2'.*\]$"),
    (["peft.target_modules=[out_proj]"], 1, r"matches model\.\S+\.self_attn\.out_proj, inside nn.MultiheadAttention"),
    (["peft.target_modules=[self_attn]", "parallelism.dp_shard=2"], 2, r"FSDP2 cannot shard"),
    (["peft.full_training_modules=[head]"], 1,
     r"^peft.full_training_modules=\['head'\]: 'head' names no module of ACTPolicy. Fix: choose among \[.*'action_head'"),
    (["parallelism.dp_shard=2", "accelerator.fsdp.ignored_modules=model.action_head"], 2,
     r"^accelerator.fsdp.ignored_modules='model.action_head': matches no module of the PEFT model, whose module "
     r"names begin with 'base_model.model.' .* Fix: begin the pattern with '.\*', e.g. "
     r"accelerator.fsdp.ignored_modules='.\*model.action_head'$"),
    (["peft.method_type=IA3"], 1, r"^peft.method_type='IA3': must be one of \('LORA',\)"),
    (["peft.lora_alpha=0"], 1, r"^peft.lora_alpha=0.0: must be > 0"),
    (["peft.r=0"], 1, r"^peft.r=0: must be >= 1"),
])
def test_peft_errors_name_key_value_and_fix(base_dir: Path, extra: list[str], world_size: int, message: str) -> None:
    error = _validation_error(_lora(base_dir, *extra), world_size)
    assert re.search(message, error), error


def test_peft_needs_a_base(tmp_path: Path) -> None:
    assert _validation_error([*VALID, "peft=lora"]) == (
        "policy.path=None: peft.method_type=LORA fine-tunes a pretrained base, and none is given. Fix: "
        "policy.path=<run>/checkpoints/last/pretrained_model"
    )


def test_dcp_only_policy_path_names_the_converter(base_dir: Path, tmp_path: Path) -> None:
    dcp_only = shutil.copytree(base_dir, tmp_path / "pretrained_model")
    (dcp_only / "model.safetensors").unlink()
    (dcp_only / "pytorch_model_fsdp_0").mkdir()
    error = _validation_error([*VALID, f"policy.path={dcp_only}"])
    assert error.startswith(f"policy.path={str(dcp_only)!r}: holds DCP shards only (pytorch_model_fsdp_0/")
    assert error.endswith(f"Fix: lerobot-mg-convert-dcp checkpoint_dir={dcp_only}, then rerun with the same policy.path")


def test_bf16_base_under_sharding_needs_mixed_precision(bf16_base_dir: Path) -> None:
    sharded = _lora(bf16_base_dir, "parallelism.dp_shard=2")
    error = _validation_error(sharded, 2)
    assert error.startswith("accelerator.mixed_precision='no': the base at policy.path is stored in bfloat16")
    assert error.endswith("Fix: accelerator.mixed_precision=bf16")
    preflight(_train_config([*sharded, "accelerator.mixed_precision=bf16"]), 2)  # the fix works
    preflight(_train_config(_lora(bf16_base_dir)), 1)  # one process: no FSDP2 unit to keep uniform


def _wrapped(base: Path, **peft: object) -> torch.nn.Module:
    cfg = _train_config(_lora(base))
    return wrap_with_lora(load_base_policy(cfg.policy, str(base)), PeftConfig(method_type="LORA", **peft), str(base))


def test_missing_alpha_means_scale_one_never_peft_default(base_dir: Path) -> None:
    from peft import LoraConfig

    model = _wrapped(base_dir, r=4)
    layer = model.base_model.model.model.encoder.layers[0].linear1
    assert layer.scaling["default"] == 1.0 and model.peft_config["default"].lora_alpha == 4.0
    assert LoraConfig(r=4).lora_alpha / 4 == 2.0  # what leaving alpha to peft would have done
    assert _wrapped(base_dir, r=4, lora_alpha=8).base_model.model.model.encoder.layers[0].linear1.scaling[
        "default"] == 2.0


def test_dtypes_of_a_bf16_base(bf16_base_dir: Path) -> None:
    """As the guide says: adapters fp32, full-training copies in the base dtype, the frozen base untouched."""
    model = _wrapped(bf16_base_dir, r=4, full_training_modules=["action_head"])
    trainable = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.dtype for name, p in model.named_parameters() if not p.requires_grad}
    assert {d for n, d in trainable.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in trainable.items() if "modules_to_save" in n} == {torch.bfloat16}
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert set(frozen.values()) == {torch.bfloat16} and any(n.endswith("original_module.weight") for n in frozen)


def test_wrap_units_are_found_inside_the_peft_model(base_dir: Path) -> None:
    units, rule = select_wrap_units(_wrapped(base_dir, r=4), None, None)
    assert rule == "ACTPolicy._fsdp_wrap_modules=['ACTEncoderLayer', 'ACTDecoderLayer']"
    assert {name for name, _ in units} == {
        "base_model.model.model.encoder.layers.0", "base_model.model.model.encoder.layers.1",
        "base_model.model.model.decoder.layers.0", "base_model.model.model.vae_encoder.layers.0",
        "base_model.model.model.vae_encoder.layers.1",
    }


def test_adapter_file_has_peft_keys_and_loads_merged_or_not(base_dir: Path, tmp_path: Path) -> None:
    from peft import get_peft_model_state_dict

    model = _wrapped(base_dir, r=4, full_training_modules=["action_head"])
    torch.manual_seed(1)
    for param in model.parameters():
        if param.requires_grad:  # lora_B starts at zero: move every trainable weight so the adapter matters
            param.data.add_(0.1 * torch.randn_like(param))
    adapter = AdapterWeights.of(model)
    expected = get_peft_model_state_dict(model)
    written = adapter.to_adapter(model.state_dict())
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
    assert adapter.to_model(written, tmp_path).keys() == {n for n, p in model.named_parameters() if p.requires_grad}

    adapter.write(tmp_path, written)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base_dir.resolve()) and saved["lora_alpha"] == 4.0
    assert "path" not in json.loads((tmp_path / "config.json").read_text())  # LeRobot's fields only

    batch = {"observation.state": torch.randn(3, 2)}
    model.eval()
    merged, unmerged = load_policy(tmp_path), load_policy(tmp_path, merge_adapter=False)
    assert type(merged) is ACTPolicy and type(unmerged).__name__ == "PeftModel"
    want = model.predict_action_chunk(batch)
    torch.testing.assert_close(merged.predict_action_chunk(batch), want, rtol=0, atol=1e-5)
    # Not bit for bit: the loaded adapter is frozen, the trained one requires grad, and torch's linear takes another
    # kernel for a strided 3-D input then (an Intel CPU's MKL parts them by an ulp in 43 of 60 entries)
    assert_close(unmerged.predict_action_chunk(batch), want, **FLOAT32_ULPS)
    assert (load_policy(base_dir).predict_action_chunk(batch) - want).abs().max() > 1e-3  # the adapter matters


LEROBOT = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1"
LEROBOT_LORA = LEROBOT / "act_state_lora" / "pretrained_model"
# The 10 modules of LeRobot's act_state_lora adapter (PROVENANCE.md there), under the same names here.
SHARED_TARGETS = [*(f"model.encoder.layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)),
                  "model.decoder.layers.0.linear1", "model.decoder.layers.0.linear2",
                  "model.encoder_robot_state_input_proj", "model.encoder_env_state_input_proj",
                  "model.encoder_latent_input_proj", "model.action_head"]


def _act_state_sized_adapter(tmp_path: Path) -> tuple[torch.nn.Module, Path, Path]:
    """An ACT of act_state's sizes saved as a base, wrapped as act_state_lora is (r 4, alpha 8), its adapter moved
    off PEFT's init, and written as a checkpoint: (model in eval mode, base dir, adapter dir)."""
    import dataclasses

    from lerobot_mg.policies.act import ACTConfig

    saved = json.loads((LEROBOT / "act_state" / "pretrained_model" / "config.json").read_text())
    fields = {field.name for field in dataclasses.fields(ACTConfig)} - {"type", "normalization_mapping"}
    config = ACTConfig(**{name: value for name, value in saved.items() if name in fields})
    torch.manual_seed(0)
    base_dir = tmp_path / "base" / "pretrained_model"
    ACTPolicy(config, saved["input_features"], saved["output_features"]).save_pretrained(base_dir)
    model = wrap_with_lora(load_base_policy(config, str(base_dir)),
                           PeftConfig(method_type="LORA", r=4, lora_alpha=8, target_modules=SHARED_TARGETS),
                           str(base_dir))
    torch.manual_seed(1)
    for param in model.parameters():
        if param.requires_grad:
            param.data.add_(0.05 * torch.randn_like(param))
    adapter_dir = tmp_path / "lora" / "pretrained_model"
    adapter = AdapterWeights.of(model)
    adapter.write(adapter_dir, adapter.to_adapter(model.state_dict()))
    return model.eval(), base_dir, adapter_dir


def test_an_adapter_checkpoint_is_laid_out_as_lerobots_and_loads_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors import safe_open

    model, base_dir, adapter_dir = _act_state_sized_adapter(tmp_path)
    assert {path.name for path in adapter_dir.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                             "config.json"}
    ours = json.loads((adapter_dir / "adapter_config.json").read_text())
    lerobots = json.loads((LEROBOT_LORA / "adapter_config.json").read_text())
    assert ours.keys() == lerobots.keys()  # PEFT's own file, every field
    differ = {"base_model_name_or_path", "target_modules", "auto_mapping"}
    assert {key: ours[key] for key in lerobots if key not in differ} == {
        key: value for key, value in lerobots.items() if key not in differ}
    assert ours["base_model_name_or_path"] == str(base_dir.resolve()) and ours["inference_mode"] is True
    # PEFT's record of the base, with the digest of its weights beside it (PEFT and LeRobot ignore the key).
    assert ours["auto_mapping"] == {"base_model_class": "ACTPolicy", "parent_library": ACTPolicy.__module__,
                                    BASE_SHA256_KEY: weights_sha256(base_dir.resolve())}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as mine, \
            safe_open(str(LEROBOT_LORA / "adapter_model.safetensors"), "pt") as theirs:
        assert mine.metadata() == theirs.metadata() == {"format": "pt"}
        shapes = {key: mine.get_slice(key).get_shape() for key in mine.keys()}  # noqa: SIM118 (not a dict)
        theirs_keys = list(theirs.keys())
        wanted = {key: theirs.get_slice(key).get_shape() for key in theirs_keys
                  if key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] in SHARED_TARGETS}
    assert len(SHARED_TARGETS) == 10 and len(wanted) == 2 * len(SHARED_TARGETS) and shapes == wanted
    assert len(wanted) == len(theirs_keys)  # every key of LeRobot's adapter
    policy_config = json.loads((adapter_dir / "config.json").read_text())  # LeRobot's record of a PEFT policy
    assert (policy_config["use_peft"], policy_config["pretrained_path"]) == (True, str(base_dir.resolve()))

    batch = {"observation.state": torch.randn(3, 14), "observation.environment_state": torch.randn(3, 14)}
    want = model.predict_action_chunk(batch)
    by_peft = PeftModel.from_pretrained(load_policy(base_dir), str(adapter_dir)).eval()  # PEFT's own loader
    # Frozen loaded adapters against the trainable one: another linear kernel may run (see the test above)
    assert_close(by_peft.predict_action_chunk(batch), want, **FLOAT32_ULPS)
    assert_close(load_policy(adapter_dir, merge_adapter=False).predict_action_chunk(batch), want, **FLOAT32_ULPS)


def test_a_merged_adapter_checkpoint_is_a_plain_pretrained_model(tmp_path: Path) -> None:
    from lerobot_mg.peft.lora import save_merged

    model, _, adapter_dir = _act_state_sized_adapter(tmp_path)
    (adapter_dir / "policy_preprocessor.json").write_text("{}")  # travels unchanged
    merged_dir = tmp_path / "merged" / "pretrained_model"
    save_merged(adapter_dir, merged_dir)
    assert {path.name for path in merged_dir.iterdir()} == {"config.json", "model.safetensors",
                                                            "policy_preprocessor.json"}
    batch = {"observation.state": torch.randn(3, 14), "observation.environment_state": torch.randn(3, 14)}
    merged = load_policy(merged_dir)
    assert type(merged) is ACTPolicy
    torch.testing.assert_close(merged.predict_action_chunk(batch), load_policy(adapter_dir).predict_action_chunk(batch),
                               rtol=0, atol=1e-6)  # the same merged weights, up to the kernels' rounding
    torch.testing.assert_close(merged.predict_action_chunk(batch), model.predict_action_chunk(batch),
                               rtol=0, atol=1e-5)


def test_lerobots_relative_base_path_is_read_in_the_current_directory_only(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """LeRobot writes --policy.path as typed (relative to where training ran), and PEFT and LeRobot read it from the
    current directory: so does lerobot_mg, inside it, and nowhere else (no folder above the adapter is searched)."""
    assert json.loads((LEROBOT_LORA / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "act_state/pretrained_model")
    monkeypatch.chdir(LEROBOT)  # the folder LeRobot trained in, holding both
    assert adapter_base_path(LEROBOT_LORA) == str((LEROBOT / "act_state" / "pretrained_model").resolve())
    monkeypatch.chdir(LEROBOT / "act_state_lora")  # a folder above the adapter, but not the one training ran in
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"names the base act_state/pretrained_model, which is no directory under "
                                          r"the current directory .*could not be had"):
        adapter_base_path(LEROBOT_LORA)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "act_state").symlink_to(LEROBOT / "act_state")  # a link out of the current directory
    with pytest.raises(ConfigError, match=r"base_model_name_or_path='act_state/pretrained_model' leads out of "
                                          r".* through a symlink"):
        adapter_base_path(LEROBOT_LORA)
    (tmp_path / "act_state").unlink()
    shutil.copytree(LEROBOT / "act_state", tmp_path / "act_state")
    assert Path(adapter_base_path(LEROBOT_LORA)) == (tmp_path / "act_state" / "pretrained_model").resolve()


def _with_base(adapter_dir: Path, directory: Path, recorded: str, digest: bool = True) -> Path:
    """A copy of ``adapter_dir`` in ``directory`` whose adapter_config.json names the base ``recorded``."""
    copy = shutil.copytree(adapter_dir, directory)
    config = json.loads((copy / "adapter_config.json").read_text())
    if not digest:
        config["auto_mapping"].pop(BASE_SHA256_KEY)
    (copy / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": recorded}))
    return copy


def test_a_base_is_recorded_for_others_and_read_back_only_where_the_adapter_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trained from a folder holding the base, the adapter names it relative to that folder; a base outside the
    current directory is named by its absolute path (read back with its digest, or without as LeRobot's); '..', a loop
    back to the adapter and another base of the same name are refused, each in one line."""
    monkeypatch.chdir(tmp_path)
    _, base_dir, adapter_dir = _act_state_sized_adapter(tmp_path)
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (saved["base_model_name_or_path"], saved["revision"]) == ("base/pretrained_model", None)
    assert saved["auto_mapping"][BASE_SHA256_KEY] == weights_sha256(base_dir.resolve())
    assert json.loads((adapter_dir / "config.json").read_text())["pretrained_path"] == "base/pretrained_model"

    outside = _with_base(adapter_dir, tmp_path / "a" / "pretrained_model", str(base_dir.resolve()))
    assert adapter_base_path(outside) == str(base_dir.resolve())  # pinned by its digest
    # As LeRobot writes it after --policy.path=/abs/base (no digest): read from there, as LeRobot reads it.
    bare = _with_base(adapter_dir, tmp_path / "b" / "pretrained_model", str(base_dir.resolve()), digest=False)
    assert adapter_base_path(bare) == str(base_dir.resolve())
    up = _with_base(adapter_dir, tmp_path / "c" / "pretrained_model", "../base/pretrained_model")
    with pytest.raises(ConfigError, match=r"climbs out of its folder with '\.\.'"):
        adapter_base_path(up)
    itself = _with_base(adapter_dir, tmp_path / "d" / "pretrained_model", "d/pretrained_model", digest=False)
    with pytest.raises(ConfigError, match=r"base_model_name_or_path='d/pretrained_model' leads back to the adapter "
                                          r"itself"):
        load_policy(itself)
    # Two adapters naming each other: the loop is found on the way, not recursed into.
    first = _with_base(adapter_dir, tmp_path / "e" / "pretrained_model", "f/pretrained_model", digest=False)
    _with_base(adapter_dir, tmp_path / "f" / "pretrained_model", "e/pretrained_model", digest=False)
    with pytest.raises(ConfigError, match=r"leads back to the adapter .*e/pretrained_model, which would load"):
        load_policy(first)

    shutil.move(str(base_dir.parent), str(tmp_path / "kept"))
    _save_base_like(tmp_path / "kept" / "pretrained_model", tmp_path / "base" / "pretrained_model")
    with pytest.raises(ConfigError, match=r"adapter_config.json: the adapter was trained on the base "
                                          r"base/pretrained_model whose weights have sha256"):
        load_policy(adapter_dir)


def _save_base_like(kept: Path, directory: Path) -> None:
    """Another base of the same config at ``directory``: other weights."""
    policy = load_policy(kept)
    torch.manual_seed(7)
    for param in policy.parameters():
        param.data.add_(torch.randn_like(param))
    policy.save_pretrained(directory)
