"""A base policy's files are data: config.json strings stay literal text, an unknown policy type is refused in one line,
and a LoRA run on a base publishes as LeRobot publishes (private repo, license and tags in the card) an adapter that
names its base so that others can load it, pinned by the digest of the base's weights.

The run here is real (one process, two steps) and publishes to a Hub on 127.0.0.1 (tests/hub_server.py) through
huggingface_hub's own client.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.literal import literal_values
from lerobot_mg.config.loading import to_train_config
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import BASE_SHA256_KEY, apply_policy_path, weights_sha256
from lerobot_mg.peft.build import build_policy
from lerobot_mg.peft.lora import AdapterWeights, load_policy
from lerobot_mg.policies.saved_config import read_saved_policy
from tests.hub_server import FakeHub
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.unit.test_config import _compose
from tests.unit.test_lerobot_format import (
    FINETUNE,
    HUB_COMMIT,
    HUB_REPO_ID,
    _hub_cache,
    lerobot_base,
    write_fixture_dataset,
)

SECRET = "s3cr3t-from-the-environment"


@pytest.mark.parametrize("text", ["${oc.env:SOME_SECRET}", "a${b}c", "\\${a}", "x\\", "\\\\${a}", "${", "plain",
                                  "${a:${b}}", "a\\b${c}"])
def test_literal_values_resolve_to_their_own_text(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_SECRET", SECRET)
    config = OmegaConf.create(literal_values({"value": text, "nested": {"list": [text, 3, None]}}, "config.json"))
    assert OmegaConf.to_container(config, resolve=True) == {"value": text, "nested": {"list": [text, 3, None]}}


def test_a_base_of_a_type_we_do_not_build_is_refused_naming_the_types_we_do(tmp_path: Path) -> None:
    base = lerobot_base(tmp_path / "pretrained_model")
    config = json.loads((base / "config.json").read_text())
    for policy_type in ("vqbet", ["act"]):
        (base / "config.json").write_text(json.dumps({**config, "type": policy_type}))
        with pytest.raises(ConfigError) as error:
            read_saved_policy(base)
        assert str(error.value) == (
            f"policy.path={str(base)!r}: its config.json names the policy type {policy_type!r}, which lerobot_mg "
            "does not build (it builds act, diffusion, pi0, pi05, smolvla). Fix: policy.path=<a pretrained_model directory of one of "
            "those types>")
        overrides = [*TINY_RUN, f"dataset.root={PUSHT_SLICE}", f"policy.path={base}"]
        with pytest.raises(ConfigError, match=r"^policy.path=.*names the policy type"):
            apply_policy_path(_compose(overrides), overrides)


def _files_holding(root: Path, text: str) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and text.encode() in path.read_bytes()]


def test_a_lora_run_on_a_base_with_interpolations_publishes_nothing_of_the_environment(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """The base's config.json holds ``${oc.env:...}`` in LeRobot's ``license``, ``tags`` and ``device``, one of them
    naming a variable that is not set. The run starts, trains, saves and publishes privately; the secret is in no
    file it wrote and in nothing it uploaded, and the values stay the base's literal text."""
    work = tmp_path / "work"  # the run's current directory, holding the base
    base = lerobot_base(work / "base" / "pretrained_model")
    config = json.loads((base / "config.json").read_text())
    planted = {"license": "${oc.env:SOME_SECRET}", "device": "${oc.env:SOME_SECRET}",
               "tags": ["${oc.env:SOME_SECRET}", "from-${oc.env:LEROBOT_MG_TEST_UNSET}"]}
    (base / "config.json").write_text(json.dumps({**config, **planted}, indent=4))
    dataset = write_fixture_dataset(tmp_path / "dataset")
    run_dir = work / "outputs" / "run"
    with FakeHub() as hub:
        proc = run_train([*FINETUNE, f"dataset.root={dataset}", f"policy.path={base}", "peft=lora", "peft.r=4",
                          "policy.repo_id=me/lora", "policy.private=true", f"output_dir={run_dir}"],
                         cwd=work, env={**hub.env(), "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
                                        "SOME_SECRET": SECRET})
    assert SECRET not in proc.stdout
    assert _files_holding(tmp_path, SECRET) == []
    repo = hub.repos["me/lora"]
    assert not [name for name, content in repo.files.items() if SECRET.encode() in content]

    pretrained = run_dir / "checkpoints" / "last" / "pretrained_model"
    ours = json.loads((pretrained / "config.json").read_text())
    assert {name: ours[name] for name in planted} == planted  # the base's text, as it was
    # Published as LeRobot publishes: a private repo, the card's license and tags from the policy config.
    assert repo.private and repo.created_with["visibility"] == "private"
    card = (pretrained / "README.md").read_text()
    assert repo.files["README.md"] == card.encode()
    front = card.split("---")[1]
    assert "license: ${oc.env:SOME_SECRET}\n" in front
    assert "- ${oc.env:SOME_SECRET}\n- from-${oc.env:LEROBOT_MG_TEST_UNSET}\n" in front and "- robotics\n" in front
    assert "| base model | base/pretrained_model |" in card

    # The adapter names its base as others find it (relative to the folder the run ran in) with its digest.
    adapter_config = json.loads(repo.files[L.ADAPTER_CONFIG_JSON])
    assert adapter_config["base_model_name_or_path"] == "base/pretrained_model" == ours["pretrained_path"]
    assert adapter_config["auto_mapping"][BASE_SHA256_KEY] == weights_sha256(base.resolve())
    assert "| dataset | dataset |" in card  # a local dataset by its folder's name: the card names no path of this disk
    for name in (L.ADAPTER_CONFIG_JSON, "config.json", "README.md"):  # what names the base: no path of this disk
        assert str(tmp_path).encode() not in repo.files[name], name

    monkeypatch.chdir(work)
    load_policy(pretrained)
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative base is not searched for in other folders
    with pytest.raises(ConfigError, match=r"names the base base/pretrained_model, which is no directory under the "
                                          rf"current directory {tmp_path}"):
        load_policy(pretrained)
    monkeypatch.chdir(work)
    shutil.copy(base / "model.safetensors", tmp_path / "kept.safetensors")
    (base / "model.safetensors").write_bytes((tmp_path / "kept.safetensors").read_bytes()[:-4] + b"    ")
    with pytest.raises(ConfigError, match=r"the adapter was trained on the base base/pretrained_model whose weights "
                                          r"have sha256 \w{12}\.\.\., and .* holds other weights"):
        load_policy(pretrained)


def test_an_adapter_on_a_hub_base_names_the_repo_id_and_its_commit(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """policy.path=<user>/<name>: the adapter records the repo id as typed and the snapshot's commit (PEFT's
    ``revision``), never the cache path."""
    base = lerobot_base(tmp_path / "pretrained_model")
    snapshot = _hub_cache(tmp_path / "hf", base)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    overrides = [*TINY_RUN, f"dataset.root={PUSHT_SLICE}", f"policy.path={HUB_REPO_ID}", "peft=lora", "peft.r=4"]
    cfg = to_train_config(apply_policy_path(_compose(overrides), overrides))
    features = json.loads((write_fixture_dataset(tmp_path / "dataset") / "meta" / "info.json").read_text())["features"]
    model = build_policy(cfg, features)
    adapter = AdapterWeights.of(model)
    adapter.write(tmp_path / "adapter", adapter.to_adapter(model.state_dict()))
    saved = json.loads((tmp_path / "adapter" / L.ADAPTER_CONFIG_JSON).read_text())
    assert (saved["base_model_name_or_path"], saved["revision"]) == (HUB_REPO_ID, HUB_COMMIT)
    assert saved["auto_mapping"][BASE_SHA256_KEY] == weights_sha256(snapshot.resolve())
    assert str(tmp_path) not in (tmp_path / "adapter" / L.ADAPTER_CONFIG_JSON).read_text()
