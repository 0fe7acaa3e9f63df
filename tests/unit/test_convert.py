"""lerobot-mg-convert-dcp: merging DCP weight shards offline, verification before deletion, arguments, hub files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from lerobot_mg.checkpoint import convert
from lerobot_mg.checkpoint.convert import (
    ConvertArgs,
    convert_checkpoint,
    main,
    read_dcp_tensors,
)
from lerobot_mg.checkpoint.hub import hub_upload_files
from lerobot_mg.cli import parse
from lerobot_mg.config.act import ACTConfig
from lerobot_mg.peft.lora import load_policy
from lerobot_mg.policies.act.modeling_act import ACTPolicy

# The shards are written without a process group on purpose; torch warns about that on every save.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FEATURES_IN = {"observation.state": {"type": "STATE", "shape": [3]}}
FEATURES_OUT = {"action": {"type": "ACTION", "shape": [2]}}


def tiny_policy() -> ACTPolicy:
    torch.manual_seed(0)
    config = ACTConfig(chunk_size=4, n_action_steps=4, dim_model=16, n_heads=2, dim_feedforward=32,
                       n_encoder_layers=1, n_decoder_layers=1, latent_dim=4, n_vae_encoder_layers=1)
    return ACTPolicy(config, FEATURES_IN, FEATURES_OUT)


def dcp_checkpoint(step_dir: Path, policy: ACTPolicy) -> Path:
    """A step directory whose weights are DCP shards only (checkpoint.format=dcp), written without a process
    group: one shard file, which the converter reads like any layout."""
    pretrained = step_dir / "pretrained_model"
    policy.write_config(pretrained)
    dcp.save({k: v.clone() for k, v in policy.state_dict().items()}, checkpoint_id=pretrained / "pytorch_model_fsdp_0",
             no_dist=True)
    return pretrained


def test_merge_equals_the_state_dict_and_loads(tmp_path: Path) -> None:
    policy = tiny_policy()
    pretrained = dcp_checkpoint(tmp_path / "005000", policy)

    merged = convert_checkpoint(tmp_path / "005000")

    assert merged == pretrained / "model.safetensors"
    assert (pretrained / "pytorch_model_fsdp_0").is_dir()  # kept unless delete_dcp
    tensors = load_file(str(merged))
    expected = policy.state_dict()
    assert tensors.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(tensors[key], tensor), key
    loaded = load_policy(pretrained)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    assert not list(pretrained.glob("*.part"))


def test_delete_dcp_leaves_a_loadable_directory(tmp_path: Path) -> None:
    policy = tiny_policy()
    pretrained = dcp_checkpoint(tmp_path / "000010", policy)

    assert main([f"--checkpoint_dir={pretrained}", "--delete_dcp=true"]) == 0  # pretrained_model/ works too

    assert sorted(p.name for p in pretrained.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_policy(pretrained)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in policy.state_dict().items())


def test_shards_stay_when_the_written_file_does_not_read_back(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pretrained = dcp_checkpoint(tmp_path / "000010", tiny_policy())

    def corrupting_save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
        from safetensors.torch import save_file

        save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, path, metadata=metadata)

    monkeypatch.setattr(convert, "save_file", corrupting_save)
    with pytest.raises(RuntimeError, match="does not read back equal to the DCP shards"):
        convert_checkpoint(tmp_path / "000010", delete_dcp=True)
    assert (pretrained / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert not (pretrained / "model.safetensors").exists()


def test_reading_in_groups_and_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    policy = tiny_policy()
    pretrained = dcp_checkpoint(tmp_path / "000010", policy)
    monkeypatch.setattr(convert, "_READ_GROUP_BYTES", 4096)  # many small reads instead of one

    tensors = read_dcp_tensors(pretrained / "pytorch_model_fsdp_0", show_progress=True)

    assert all(torch.equal(tensors[k], v) for k, v in policy.state_dict().items())
    total_bytes = sum(v.numel() * v.element_size() for v in policy.state_dict().values())
    assert "merge pytorch_model_fsdp_0" in capsys.readouterr().err
    assert total_bytes < convert._PROGRESS_MIN_BYTES  # so a default merge of this size shows no bar
    read_dcp_tensors(pretrained / "pytorch_model_fsdp_0")
    assert "merge pytorch_model_fsdp_0" not in capsys.readouterr().err


def test_peft_shards_merge_into_the_adapter_file(tmp_path: Path) -> None:
    pretrained = tmp_path / "000010" / "pretrained_model"
    adapter = {"base_model.model.encoder.lora_A.weight": torch.randn(4, 8)}
    dcp.save(adapter, checkpoint_id=pretrained / "pytorch_model_fsdp_0", no_dist=True)
    (pretrained / "adapter_config.json").write_text("{}")

    merged = convert_checkpoint(tmp_path / "000010")

    assert merged.name == "adapter_model.safetensors"
    assert torch.equal(load_file(str(merged))["base_model.model.encoder.lora_A.weight"],
                       adapter["base_model.model.encoder.lora_A.weight"])


def test_errors_name_the_directory_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_dir='.*missing' is not a directory. Fix: checkpoint_dir="):
        convert_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no pretrained_model/ directory. Fix: checkpoint_dir="):
        convert_checkpoint(tmp_path / "empty")
    safetensors_only = tmp_path / "000001" / "pretrained_model"
    tiny_policy().save_pretrained(safetensors_only)
    with pytest.raises(ValueError, match=r"holds no pytorch_model_fsdp_0/ to convert .* model.safetensors is already"):
        convert_checkpoint(tmp_path / "000001")

    optimizer_dir = tmp_path / "000002" / "pretrained_model" / "pytorch_model_fsdp_0"
    dcp.save({"state": {"w": {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]},
             checkpoint_id=optimizer_dir, no_dist=True)
    with pytest.raises(ValueError, match=r"holds non-tensor entries .*param_groups"):
        convert_checkpoint(tmp_path / "000002")

    (optimizer_dir / ".metadata").unlink()  # a save that never finished: .metadata is written last
    with pytest.raises(ValueError, match=r"pytorch_model_fsdp_0: is not a DCP checkpoint directory \(it has no "
                                         r"\.metadata file, which a save writes last\). Fix: checkpoint_dir="):
        convert_checkpoint(tmp_path / "000002")


def test_the_converter_reads_dcp_metadata_through_the_one_allow_listed_reader() -> None:
    from lerobot_mg.checkpoint import convert, unpickle

    assert convert.read_dcp_metadata is unpickle.read_dcp_metadata


@pytest.mark.parametrize(
    "argv",
    [
        ["checkpoint_dir=/runs/a/checkpoints/last", "delete_dcp=true", "push_to_hub=me/policy"],
        ["--checkpoint_dir=/runs/a/checkpoints/last", "--delete_dcp=True", "--push_to_hub=me/policy"],
        ["--checkpoint_dir", "/runs/a/checkpoints/last", "--delete_dcp", "1", "--push_to_hub", "me/policy"],
    ],
)
def test_arguments_in_both_spellings(argv: list[str]) -> None:
    assert parse(ConvertArgs, argv) == ConvertArgs(Path("/runs/a/checkpoints/last"), True, "me/policy")


def test_argument_defaults_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(ConvertArgs, ["checkpoint_dir=x"]) == ConvertArgs(Path("x"), False, None)
    with pytest.raises(ValueError, match=r"checkpoint_dir=None: is required. Fix: checkpoint_dir=<path>"):
        parse(ConvertArgs, ["delete_dcp=true"])
    with pytest.raises(ValueError, match=r"delete_dcp='maybe': expected true or false. Fix: delete_dcp=true"):
        parse(ConvertArgs, ["checkpoint_dir=x", "delete_dcp=maybe"])
    with pytest.raises(ValueError, match=r"push_to_hub=policy: expected a repo id <user>/<repo>"):
        parse(ConvertArgs, ["checkpoint_dir=x", "push_to_hub=policy"])
    with pytest.raises(ValueError, match=r"output=y: unknown argument. Fix: one of checkpoint_dir"):
        parse(ConvertArgs, ["checkpoint_dir=x", "output=y"])
    with pytest.raises(ValueError, match=r"x: is not key=value"):
        parse(ConvertArgs, ["x"])
    # The command turns them into one line and exit status 2.
    assert main(["checkpoint_dir=x", "delete_dcp=maybe"]) == 2
    assert capsys.readouterr().err == "lerobot-mg-convert-dcp: error: delete_dcp='maybe': expected true or false. Fix: delete_dcp=true\n"


def test_help_starts_with_the_commands_and_lists_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.index("lerobot-mg-convert-dcp checkpoint_dir=") < out.index("re-read and compared")
    assert "  checkpoint_dir=<path>  (required) a step directory" in out
    assert "  delete_dcp=<true|false>  (default: false) remove the shards" in out
    assert "  push_to_hub=<text>  (default: null) <user>/<repo>" in out


def test_hub_upload_selects_safetensors_json_and_md_only(tmp_path: Path) -> None:
    pretrained = tmp_path / "pretrained_model"
    (pretrained / "pytorch_model_fsdp_0").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "train_config.json", "README.md", "notes.txt",
                 "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata", "policy_preprocessor.json"):
        (pretrained / name).write_text("x")
    assert [p.name for p in hub_upload_files(pretrained)] == [
        "README.md", "config.json", "model.safetensors", "policy_preprocessor.json", "train_config.json"
    ]


def test_push_offline_fails_before_merging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    pretrained = dcp_checkpoint(tmp_path / "000010", tiny_policy())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert main([f"checkpoint_dir={tmp_path / '000010'}", "push_to_hub=me/policy", "delete_dcp=true"]) == 2
    assert "push_to_hub=me/policy: HF_HUB_OFFLINE=1 is set" in capsys.readouterr().err
    assert not (pretrained / "model.safetensors").exists()
    assert (pretrained / "pytorch_model_fsdp_0").is_dir()
