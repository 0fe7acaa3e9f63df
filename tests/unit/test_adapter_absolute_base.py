"""A LeRobot LoRA checkpoint whose adapter_config.json names its base by an absolute local path (what LeRobot 0.6.1
writes after ``--policy.path=/abs/base``, with no digest of the base) is a ``policy.path`` from any folder, read as
LeRobot reads it: the banner names the adapter and the base with the sha256 of each one's weights, and the run's
facts (ledger, checkpoints) record them. A relative base that climbs out with ``..`` or leaves through a link stays
refused (tests/unit/test_peft.py, test_untrusted_files.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.peft.base import BASE_SHA256_KEY, adapter_base_path, base_lineage, weights_sha256
from lerobot_mg.peft.lora import load_policy
from tests.launch_utils import run_train
from tests.lerobot_fixtures import FIXTURES, fixture_dir
from tests.unit.test_lerobot_format import FINETUNE, write_fixture_dataset

LORA = "act_state_lora"


def _lora_on_an_absolute_base(tmp_path: Path) -> tuple[Path, Path]:
    """LeRobot's act_state_lora with its base elsewhere, named by its absolute path (LeRobot's own record of it: no
    digest in auto_mapping); (the adapter's pretrained_model/, the base's)."""
    base = shutil.copytree(FIXTURES / "act_state", tmp_path / "bases" / "act_state") / "pretrained_model"
    adapter = shutil.copytree(fixture_dir(LORA), tmp_path / "adapters" / LORA) / "pretrained_model"
    config_path = adapter / L.ADAPTER_CONFIG_JSON
    config = json.loads(config_path.read_text())
    assert BASE_SHA256_KEY not in config["auto_mapping"]  # as LeRobot writes it
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": str(base)}, indent=2))
    return adapter, base


def test_the_absolute_base_is_read_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter, base = _lora_on_an_absolute_base(tmp_path)
    monkeypatch.chdir(tmp_path / "adapters")  # neither the folder LeRobot trained in nor one holding the base
    assert adapter_base_path(adapter) == str(base.resolve())
    assert base_lineage(str(adapter)) == [
        {"path": str(adapter.resolve()), "sha256": weights_sha256(adapter)},
        {"path": str(base), "sha256": weights_sha256(base)},
    ]
    merged = load_policy(adapter).state_dict()
    base_weights = load_file(str(base / L.MODEL_SAFETENSORS))
    assert not torch.equal(merged["model.action_head.weight"], base_weights["model.action_head.weight"])


def test_a_fine_tune_of_it_names_and_records_both_digests(tmp_path: Path) -> None:
    """policy.path=<the adapter>, started in an unrelated folder: the full fine-tune runs; the banner's base lines
    and the facts in the ledger and the checkpoint's training_step.json name the adapter and the absolute base with
    their sha256."""
    adapter, base = _lora_on_an_absolute_base(tmp_path)
    dataset = write_fixture_dataset(tmp_path / "dataset")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    proc = run_train([*FINETUNE, f"dataset.root={dataset}", f"policy.path={adapter}", f"output_dir={run_dir}"],
                     cwd=elsewhere)
    lineage = [{"path": str(adapter.resolve()), "sha256": weights_sha256(adapter)},
               {"path": str(base), "sha256": weights_sha256(base)}]
    assert f"    the adapter {adapter.resolve()}: sha256 {lineage[0]['sha256']}" in proc.stdout
    assert f"    on the base {base}: sha256 {lineage[1]['sha256']}" in proc.stdout
    start = json.loads((run_dir / "ledger.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["facts"]["model"]["base_lineage"] == lineage
    step = json.loads((run_dir / "checkpoints" / "last" / "training_state" / "training_step.json").read_text())
    assert step["facts"]["model"]["base_lineage"] == lineage
    assert (run_dir / "checkpoints" / "last" / "pretrained_model" / L.MODEL_SAFETENSORS).is_file()
