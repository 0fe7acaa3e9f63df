"""A LeRobot 0.6.1 LoRA checkpoint (tests/fixtures/lerobot_0_6_1/act_state_lora, PROVENANCE.md there) loads here
and gives LeRobot's numbers, and is a base for fine-tuning.

``act_state_lora/pretrained_model`` holds PEFT's adapter only; its adapter_config.json names the base as LeRobot
recorded ``--policy.path``: ``act_state/pretrained_model``, relative to the folder training ran in (the one holding
both fixtures). Our loader reads it where PEFT and LeRobot read it, from the current directory: the tests here run
in the folder holding both (the fixtures', or a copy of it), and one checks that nothing else is searched. Numbers: the fixture's raw batch through our preprocessor (read
from the adapter directory's own processor files) and our policy, unmerged (peft's PeftModel) against LeRobot's
``eval.*`` / ``train.*``, merged against ``merged.*``, on one thread; atol 1e-5 on tensors, 1e-6 on losses (relative
1e-6 on the large training loss).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import BASE_SHA256_KEY, weights_sha256
from lerobot_mg.peft.lora import is_peft_model, load_policy
from lerobot_mg.policies.act import ACTPolicy
from lerobot_mg.processors.normalize import load_processors
from tests.launch_utils import run_train
from tests.lerobot_fixtures import (
    FIXTURES,
    chunk_with_encoder_io,
    fixture_dir,
    pretrained_model_dir,
    reference,
)
from tests.tolerances import FLOAT32_ULPS, assert_close
from tests.unit.test_lerobot_format import FINETUNE, write_fixture_dataset

LORA = "act_state_lora"
TENSOR_ATOL, LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-6, 1e-6
# LeRobot's act_state_lora targets (PROVENANCE.md): every Linear ACT calls as a module on the inference path.
LORA_TARGETS = [*(f"model.encoder.layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)),
                "model.decoder.layers.0.linear1", "model.decoder.layers.0.linear2",
                "model.encoder_robot_state_input_proj", "model.encoder_env_state_input_proj",
                "model.encoder_latent_input_proj", "model.action_head"]


@pytest.fixture(autouse=True)
def one_thread_where_lerobot_trained(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One thread (the fixture's tolerances), in the folder LeRobot trained in (holding the adapter and its base)."""
    monkeypatch.chdir(FIXTURES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_tensor(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=TENSOR_ATOL, rtol=0)


def assert_loss(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=LOSS_ATOL, rtol=LOSS_RTOL)


def preprocessed_batch() -> dict[str, torch.Tensor]:
    """The fixture's raw batch through our preprocessor read from the adapter directory: LeRobot's ``pre.*``."""
    stored = reference(LORA)
    preprocessor, _ = load_processors(pretrained_model_dir(LORA))
    raw = {key.removeprefix("input."): value for key, value in stored.items()
           if key.startswith("input.") and key != "input.train_latent_eps"}
    batch = preprocessor(raw)
    for key in [key for key in stored if key.startswith("pre.")]:
        # float32 normalisation LeRobot's CPU computed: its kernels' ulps (tests/README.md)
        assert_close(batch[key.removeprefix("pre.")], stored[key], **FLOAT32_ULPS, msg=key)
    return batch


def act_of(model: torch.nn.Module) -> ACTPolicy:
    """The ACTPolicy inside (peft's ``get_base_model()`` of an unmerged model: its LoRA layers in place)."""
    policy = model.get_base_model() if is_peft_model(model) else model
    assert isinstance(policy, ACTPolicy)
    return policy


def test_the_base_path_is_relative_as_lerobot_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = json.loads((pretrained_model_dir(LORA) / L.ADAPTER_CONFIG_JSON).read_text())
    assert recorded["base_model_name_or_path"] == "act_state/pretrained_model"
    assert Path(recorded["base_model_name_or_path"]).resolve() == pretrained_model_dir("act_state").resolve()
    monkeypatch.chdir(tmp_path)  # elsewhere, the folders above the adapter are not searched
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=rf"names the base act_state/pretrained_model, which is no directory under "
                                          rf"the current directory {tmp_path}"):
        load_policy(pretrained_model_dir(LORA))


@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_lerobots_lora_checkpoint_gives_lerobots_numbers(merged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eval mode (loss, encoder input / position embedding / output, chunk, unnormalized chunk) and train mode with
    dropout and attention in eval() and the stored latent noise (VAE posterior, predicted chunk, losses)."""
    model = load_policy(pretrained_model_dir(LORA), merge_adapter=merged)
    assert is_peft_model(model) is not merged and not model.training
    expected = {key.removeprefix("merged."): value for key, value in reference(LORA).items()
                if key.startswith("merged.") == merged}
    batch, policy = preprocessed_batch(), act_of(model)
    loss, logs = model(batch)
    assert_loss(loss, expected["eval.loss"])
    assert_loss(logs["l1_loss"], expected["eval.l1_loss"])

    chunk, seen = chunk_with_encoder_io(model, policy, batch)
    assert_tensor(seen["tokens"], expected["eval.encoder_in_tokens"])
    assert_tensor(seen["pos_embed"], expected["eval.encoder_in_pos_embed"])
    assert_tensor(seen["out"], expected["eval.encoder_out"])
    assert_tensor(chunk, expected["eval.action_chunk"])
    _, postprocessor = load_processors(pretrained_model_dir(LORA))
    assert_tensor(postprocessor({"action": chunk})["action"], expected["eval.action_chunk_unnormalized"])
    # The adapter acts: LeRobot's chunk moved by up to 0.37 from the base's (PROVENANCE.md).
    assert (chunk - reference("act_state")["eval.action_chunk"]).abs().max() > 0.1

    model.train()
    for module in model.modules():
        if isinstance(module, (torch.nn.Dropout, torch.nn.MultiheadAttention)):
            module.eval()
    eps = reference(LORA)["input.train_latent_eps"]
    monkeypatch.setattr(torch, "randn_like", lambda like, *args, **kwargs: eps.clone())
    with torch.no_grad():
        actions_hat, (mu, log_sigma_x2) = policy.model(batch)
        loss, logs = model(batch)
    assert_tensor(mu, expected["train.vae_mu"])
    assert_tensor(log_sigma_x2, expected["train.vae_log_sigma_x2"])
    assert_tensor(actions_hat, expected["train.actions_hat"])
    assert_loss(loss, expected["train.loss"])
    assert_loss(logs["l1_loss"], expected["train.l1_loss"])
    assert_loss(logs["kld_loss"], expected["train.kld_loss"])


def test_the_adapter_covers_lerobots_ten_targets() -> None:
    """Loaded unmerged, LoRA sits on exactly the 10 modules LeRobot's adapter_model.safetensors names."""
    model = load_policy(pretrained_model_dir(LORA), merge_adapter=False)
    adapted = sorted(name.removeprefix("base_model.model.").removesuffix(".lora_A")
                     for name, _ in model.named_modules() if name.endswith(".lora_A"))
    assert adapted == sorted(LORA_TARGETS)
    stored = load_file(str(pretrained_model_dir(LORA) / L.ADAPTER_SAFETENSORS))
    assert sorted({key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in stored}) == adapted


def _copy_of_lerobots_lora(folder: Path) -> Path:
    """act_state_lora and its base side by side, as LeRobot laid them out: the adapter's pretrained_model/."""
    shutil.copytree(FIXTURES / "act_state", folder / "act_state")
    shutil.copytree(fixture_dir(LORA), folder / LORA)
    return folder / LORA / "pretrained_model"


@pytest.fixture(scope="module")
def fixture_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture_dataset(tmp_path_factory.mktemp("interop") / "dataset")


def test_a_copy_of_lerobots_lora_checkpoint_is_a_full_fine_tuning_base(fixture_dataset: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """policy.path=<a copy of act_state_lora>: the adapter is merged into its base, strictly, and a 2-step full
    fine-tune starts from there with the adapter's processors (dataset.use_base_stats=true: their statistics too);
    the run starts in the folder holding the two, as LeRobot's did, and records its base relative to it."""
    base = _copy_of_lerobots_lora(tmp_path / "interop")
    run_dir = tmp_path / "run"
    run_train([*FINETUNE, f"dataset.root={fixture_dataset}", f"policy.path={base}", "dataset.use_base_stats=true",
               f"output_dir={run_dir}"], cwd=tmp_path / "interop")
    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    ours = json.loads((pretrained / "config.json").read_text())
    lerobots = json.loads((base / "config.json").read_text())
    # LeRobot's config in, LeRobot's config out: a plain policy now, whose base is the LoRA directory (and the
    # integer LeRobot wrote for replace_final_stride_with_dilation read as the boolean it means).
    assert ours == {**lerobots, "use_peft": False, "pretrained_path": "act_state_lora/pretrained_model",
                    "push_to_hub": True, "replace_final_stride_with_dilation": False}
    assert not (pretrained / L.ADAPTER_SAFETENSORS).exists()
    for name in sorted(path.name for path in base.glob("policy_*")):  # the adapter's processors, unchanged
        assert (pretrained / name).read_bytes() == (base / name).read_bytes(), name
    monkeypatch.chdir(tmp_path / "interop")  # where the copy's own base is found
    start = load_policy(base).state_dict()  # the adapter merged into act_state
    trained = load_file(str(pretrained / L.MODEL_SAFETENSORS))
    assert sorted(trained) == sorted(start) and all(trained[k].shape == start[k].shape for k in start)
    assert any(not torch.equal(trained[key], start[key]) for key in start)  # it trained from there
    act_state = load_file(str(pretrained_model_dir("act_state") / L.MODEL_SAFETENSORS))
    assert not torch.equal(start["model.action_head.weight"], act_state["model.action_head.weight"])  # merged


def test_a_copy_of_lerobots_lora_checkpoint_is_a_lora_base(fixture_dataset: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A new LoRA on the merged LeRobot adapter: our adapter checkpoint records the LoRA directory as its base,
    relative to the folder the run started in (config.json: use_peft, pretrained_path; adapter_config.json:
    base_model_name_or_path, with the digest of the LoRA's weights) and loads back from there."""
    base = _copy_of_lerobots_lora(tmp_path / "interop")
    run_dir = tmp_path / "interop" / "outputs" / "run"
    run_train([*FINETUNE, f"dataset.root={fixture_dataset}", f"policy.path={base}", "peft=lora", "peft.r=4",
               f"output_dir={run_dir}"], cwd=tmp_path / "interop")
    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    assert (pretrained / L.ADAPTER_SAFETENSORS).is_file() and not (pretrained / L.MODEL_SAFETENSORS).exists()
    ours = json.loads((pretrained / "config.json").read_text())
    assert (ours["use_peft"], ours["pretrained_path"]) == (True, "act_state_lora/pretrained_model")
    recorded = json.loads((pretrained / L.ADAPTER_CONFIG_JSON).read_text())
    assert recorded["base_model_name_or_path"] == "act_state_lora/pretrained_model"
    assert recorded["auto_mapping"][BASE_SHA256_KEY] == weights_sha256(base.resolve())
    monkeypatch.chdir(tmp_path / "interop")
    batch = preprocessed_batch()
    observation = {k: v for k, v in batch.items() if not k.startswith("action")}
    assert_tensor(load_policy(pretrained, merge_adapter=False).predict_action_chunk(observation),
                  load_policy(pretrained).predict_action_chunk(observation))
