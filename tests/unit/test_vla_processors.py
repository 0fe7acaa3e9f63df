"""The processors of pi0, pi0.5 and SmolVLA are LeRobot 0.6.1's, both ways, on the fixtures of
tests/fixtures/lerobot_0_6_1 (PROVENANCE_vla.md); their tokenizers come from a directory or huggingface_hub's cache.

In: our reader loads LeRobot's policy_{pre,post}processor files and turns the fixture's raw batch (``input.*`` with
the task strings, cameras through our uint8 -> [0, 1] step) into LeRobot's ``pre.*`` (the prompt's tokens and mask,
the normalised state and action), and LeRobot's normalised action chunk back into its unnormalised one. Out: the
processors built from the policy's config.json and the fixture's dataset_stats.json are LeRobot's files, byte for
byte. The fixtures' tokenizer paths are relative to tests/fixtures/lerobot_0_6_1, so those tests run there (as
LeRobot's own code must).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lerobot_mg.data import LeRobotDataset
from lerobot_mg.errors import ConfigError
from lerobot_mg.processors import (
    NormalizerStep,
    Pi05StatePromptStep,
    PolicyProcessorPipeline,
    RelativeActionsStep,
    TokenizerStep,
    UnnormalizerStep,
    check_tokenizers,
    load_processors,
    make_processors,
    with_imagenet_stats,
)
from lerobot_mg.processors.language import LANGUAGE_ATTENTION_MASK, LANGUAGE_TOKENS
from lerobot_mg.processors.tokenizer_source import PALIGEMMA_TOKENIZER, TOKENIZER_FILES, resolve_tokenizer
from lerobot_mg.step import to_device
from scripts.synthetic_dataset import TASK, write_state_dataset
from tests.launch_utils import PYTHON, REPO, clean_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1"
VLAS = ["pi0_tiny", "pi05_tiny", "smolvla_tiny"]
TOKENIZER_DIR = {"pi0_tiny": "pi0_tiny/tiny_tokenizer", "pi05_tiny": "pi05_tiny/tiny_tokenizer",
                 "smolvla_tiny": "smolvla_tiny/tiny_vlm"}
UINT8_SUFFIX = ".uint8"
ATOL = 1e-6  # normalised state and action (they come out bit-identical; this is PROVENANCE_vla.md's tolerance)


@pytest.fixture
def in_fixtures(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Runs the test in the folder the fixtures' relative tokenizer paths start from."""
    monkeypatch.chdir(FIXTURES)
    return FIXTURES


def _pretrained(name: str) -> Path:
    return FIXTURES / name / "pretrained_model"


def _reference(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return (load_file(str(FIXTURES / name / "reference.safetensors")),
            json.loads((FIXTURES / name / "reference.json").read_text()))


def _raw_batch(name: str) -> tuple[dict[str, Any], list[str]]:
    """The fixture's raw batch as our DataLoader hands it over (cameras as uint8, a task string per sample)."""
    tensors, described = _reference(name)
    batch: dict[str, Any] = {key.removeprefix("input."): value for key, value in tensors.items()
                             if key.startswith("input.")}
    cameras = [key.removesuffix(UINT8_SUFFIX) for key in batch if key.endswith(UINT8_SUFFIX)]
    for camera in cameras:
        batch[camera] = batch.pop(camera + UINT8_SUFFIX)
    batch["task"] = list(described["tasks"])
    return batch, cameras


def _policy_config(name: str) -> SimpleNamespace:
    """The policy config as config.json holds it, read by field name as the processors read H1's and H2's
    dataclasses; pi0's and pi0.5's tokenizer (which LeRobot hard-codes) from the lerobot_mg-only ``tokenizer_name``."""
    config = json.loads((_pretrained(name) / "config.json").read_text())
    if config["type"] in ("pi0", "pi05"):
        config["tokenizer_name"] = TOKENIZER_DIR[name]
    return SimpleNamespace(**config)


@pytest.mark.parametrize("name", VLAS)
def test_lerobots_vla_processors_give_lerobots_batch(name: str, in_fixtures: Path) -> None:
    tensors, described = _reference(name)
    preprocessor, postprocessor = load_processors(_pretrained(name))
    raw, cameras = _raw_batch(name)
    out = preprocessor(to_device(raw, torch.device("cpu"), uint8_keys=cameras))
    assert out[LANGUAGE_TOKENS].dtype == torch.int64 and out[LANGUAGE_ATTENTION_MASK].dtype == torch.bool
    assert torch.equal(out[LANGUAGE_TOKENS], tensors[f"pre.{LANGUAGE_TOKENS}"])
    assert torch.equal(out[LANGUAGE_ATTENTION_MASK], tensors[f"pre.{LANGUAGE_ATTENTION_MASK}"])
    for key in ("observation.state", "action"):
        torch.testing.assert_close(out[key], tensors[f"pre.{key}"], atol=ATOL, rtol=0)
    prompts = described.get("prompts_after_pi05_step", described.get("prompts_after_newline_step"))
    assert out["task"] == prompts  # the prompt the tokens were made from
    tokenizer = preprocessor.step(TokenizerStep).tokenizer
    assert [tokenizer.convert_ids_to_tokens(row) for row in out[LANGUAGE_TOKENS].tolist()] == described["token_strings"]
    actions = postprocessor({"action": tensors["eval.action_chunk"]})["action"]
    torch.testing.assert_close(actions, tensors["eval.action_chunk_unnormalized"], atol=ATOL, rtol=0)


def test_the_pi05_prompt_holds_the_binned_state_with_lerobots_edges(in_fixtures: Path) -> None:
    """Sample 1's state dims 0 and 1 sit at mean -/+ 4 std: below q01 and above q99, so bins -1 and 255."""
    tensors, described = _reference("pi05_tiny")
    preprocessor, _ = load_processors(_pretrained("pi05_tiny"))
    normalised = preprocessor.step(NormalizerStep)(_raw_batch("pi05_tiny")[0])["observation.state"]
    assert normalised[1, 0] < -1 and normalised[1, 1] > 1
    prompts = Pi05StatePromptStep()({"observation.state": normalised, "task": described["tasks"]})["task"]
    assert prompts == described["prompts_after_pi05_step"]
    assert ", State: -1 255 " in prompts[1]
    edges = torch.tensor([[-1.0, -1.0 - 1e-6, 1.0, 1 - 2 / 256, 1 - 2 / 256 - 1e-6, 0.0]])
    prompt = Pi05StatePromptStep()({"observation.state": edges, "task": " put_the cube\n"})["task"]
    assert prompt == ["Task: put the cube, State: 0 -1 255 255 254 128;\nAction: "]


@pytest.mark.parametrize("name", VLAS)
def test_vla_processors_built_from_the_config_are_lerobots_files(name: str, in_fixtures: Path,
                                                                  tmp_path: Path) -> None:
    policy_cfg = _policy_config(name)
    stats = json.loads((FIXTURES / name / "dataset_stats.json").read_text())
    cameras = [key for key in stats if key.startswith("observation.images.")]  # the dataset's, not pi0.5's empty one
    preprocessor, postprocessor = make_processors(policy_cfg, policy_cfg.input_features, policy_cfg.output_features,
                                                  with_imagenet_stats(stats, cameras), device=policy_cfg.device)
    preprocessor.save_pretrained(tmp_path)
    postprocessor.save_pretrained(tmp_path)
    lerobots = sorted(path.name for path in _pretrained(name).glob("policy_*"))
    assert sorted(path.name for path in tmp_path.iterdir()) == lerobots
    for file_name in lerobots:
        ours, theirs = tmp_path / file_name, _pretrained(name) / file_name
        if file_name.endswith(".json"):  # the same steps, order, config keys and tokenizer path
            assert json.loads(ours.read_text()) == json.loads(theirs.read_text()), file_name
        else:
            assert load_file(str(ours)).keys() == load_file(str(theirs)).keys(), file_name
        assert ours.read_bytes() == theirs.read_bytes(), file_name


@pytest.mark.parametrize("name", VLAS)
def test_lerobots_vla_files_round_trip_through_ours(name: str, in_fixtures: Path, tmp_path: Path) -> None:
    for pipeline in load_processors(_pretrained(name)):
        pipeline.save_pretrained(tmp_path)
    for path in tmp_path.iterdir():
        assert path.read_bytes() == (_pretrained(name) / path.name).read_bytes(), path.name


def test_smolvla_pads_to_the_longest_prompt_and_pi0_to_max_length(in_fixtures: Path) -> None:
    smolvla, _ = make_processors(*_config_features_stats("smolvla_tiny"))
    pi0, _ = make_processors(*_config_features_stats("pi0_tiny"))
    one = {"observation.state": torch.zeros(6), "task": "pick up the red cube"}  # one sample, unbatched
    assert smolvla(dict(one))[LANGUAGE_TOKENS].shape == (1, 6)  # 5 words and the newline
    tokens = pi0(dict(one))[LANGUAGE_TOKENS]
    assert tokens.shape == (1, 16)
    long_task = {**one, "task": " ".join(["pick up the red cube"] * 10)}
    assert torch.equal(pi0(long_task)[LANGUAGE_ATTENTION_MASK], torch.ones(1, 16, dtype=torch.bool))  # cut


def _config_features_stats(name: str) -> tuple[SimpleNamespace, dict, dict, dict]:
    policy_cfg = _policy_config(name)
    stats = json.loads((FIXTURES / name / "dataset_stats.json").read_text())
    return policy_cfg, policy_cfg.input_features, policy_cfg.output_features, stats


def test_each_frames_task_comes_from_the_dataset_through_the_dataloader(in_fixtures: Path, tmp_path: Path) -> None:
    """The dataset item's ``task`` (its tasks table's string) is collated into a list per batch and tokenised."""
    root = write_state_dataset(tmp_path / "dataset", num_frames=20, dim=6, episode_length=10, num_files=1)
    dataset = LeRobotDataset(root, {"action": [0.0]}, keys=("observation.state", "action"))
    batch = next(iter(DataLoader(dataset, batch_size=2)))
    assert batch["task"] == [TASK, TASK]
    features = {"observation.state": {"type": "STATE", "shape": [6]}}
    pi0 = SimpleNamespace(**{**vars(_policy_config("pi0_tiny")), "input_features": features,
                             "output_features": {"action": {"type": "ACTION", "shape": [6]}}})
    preprocessor, _ = make_processors(pi0, pi0.input_features, pi0.output_features, dataset.stats)
    out = preprocessor(batch)
    expected = preprocessor.step(TokenizerStep).tokenizer([TASK + "\n"] * 2, padding="max_length", max_length=16,
                                                           return_tensors="pt")
    assert torch.equal(out[LANGUAGE_TOKENS], expected["input_ids"])
    assert torch.equal(out[LANGUAGE_ATTENTION_MASK], expected["attention_mask"].bool())
    assert 2 < int(out[LANGUAGE_ATTENTION_MASK][0].sum()) < 16  # the task's tokens, then padding


@pytest.mark.parametrize("mode, low, high", [("QUANTILES", "q01", "q99"), ("QUANTILE10", "q10", "q90")])
def test_quantile_modes_are_lerobots_formulas(mode: str, low: str, high: str) -> None:
    features = {"observation.state": {"type": "STATE", "shape": [3]}, "action": {"type": "ACTION", "shape": [3]}}
    stats = {key: {low: torch.tensor([-1.0, 0.0, 2.0]), high: torch.tensor([1.0, 4.0, 2.0])} for key in features}
    norm_map = {"STATE": mode, "ACTION": mode}
    normalizer = NormalizerStep(features, norm_map, stats)
    unnormalizer = UnnormalizerStep({"action": features["action"]}, norm_map, stats)
    x = torch.tensor([[0.5, 1.0, 2.0], [-1.0, 4.0, 3.0]])
    q_low, q_high = stats["action"][low], stats["action"][high]
    denom = torch.where(q_high - q_low == 0, torch.tensor(1e-8), q_high - q_low)  # a zero range counts as eps
    expected = 2.0 * (x - q_low) / denom - 1.0
    out = normalizer({"observation.state": x, "action": x})
    assert torch.equal(out["action"], expected) and torch.equal(out["observation.state"], expected)
    assert torch.equal(out["action"][1, :2], torch.tensor([-1.0, 1.0]))  # the quantiles land on -1 and 1
    assert torch.equal(unnormalizer({"action": expected})["action"], (expected + 1.0) * denom / 2.0 + q_low)
    with pytest.raises(ConfigError, match=f"needs the '{high}' statistic"):
        NormalizerStep(features, norm_map, {key: {low: value[low]} for key, value in stats.items()})


def test_relative_actions_are_refused_in_one_line(in_fixtures: Path, tmp_path: Path) -> None:
    policy_cfg, *rest = _config_features_stats("pi0_tiny")
    policy_cfg.use_relative_actions = True
    with pytest.raises(ConfigError, match=r"^policy.use_relative_actions=True: .* Fix: policy.use_relative_actions"
                                          r"=false$"):
        make_processors(policy_cfg, *rest)
    for file_name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        saved = json.loads((_pretrained("pi0_tiny") / file_name).read_text())
        for step in saved["steps"]:
            if step["registry_name"] in ("relative_actions_processor", "absolute_actions_processor"):
                step["config"]["enabled"] = True
        (tmp_path / file_name).write_text(json.dumps(saved))
        for state_file in _pretrained("pi0_tiny").glob(f"{file_name.removesuffix('.json')}_step_*"):
            shutil.copy(state_file, tmp_path)
        with pytest.raises(ConfigError, match="use_relative_actions"):
            PolicyProcessorPipeline.from_pretrained(tmp_path, file_name.removesuffix(".json"))
    assert RelativeActionsStep()({"action": torch.ones(1)})["action"].item() == 1.0  # disabled: passes through


# -- tokenizers from the Hub: offline, an empty or a filled huggingface_hub cache, no network ----------------------

@pytest.fixture
def offline_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty huggingface_hub cache in tmp_path, offline (HF_HUB_CACHE is read when huggingface_hub is imported,
    so its constant is pointed there too)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_an_uncached_tokenizer_offline_is_refused_with_the_download_command(offline_cache: Path) -> None:
    repo = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    smolvla = SimpleNamespace(type="smolvla", vlm_model_name=repo)
    with pytest.raises(ConfigError) as refused:
        check_tokenizers(smolvla)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"policy.vlm_model_name='{repo}': is not in huggingface_hub's cache, and "
                              "HF_HUB_OFFLINE=1 forbids")
    assert message.endswith(f"Fix: fetch it while online: hf download {repo}"
                            + "".join(f' --include "{pattern}"' for pattern in TOKENIZER_FILES))
    assert "gated" not in message
    with pytest.raises(ConfigError) as gated:  # pi0's default: PaliGemma's tokenizer, a gated repo
        check_tokenizers(SimpleNamespace(type="pi0"))
    message = str(gated.value)
    assert "\n" not in message and message.startswith(f"policy.tokenizer_name='{PALIGEMMA_TOKENIZER}': ")
    assert f"hf download {PALIGEMMA_TOKENIZER} --include" in message
    assert f"is gated: accept its licence on https://huggingface.co/{PALIGEMMA_TOKENIZER} first" in message
    assert list(offline_cache.iterdir()) == []  # nothing written, nothing fetched


def test_the_environment_alone_points_at_the_cache_and_forbids_downloads(tmp_path: Path) -> None:
    """As a user sets it: HF_HUB_CACHE and HF_HUB_OFFLINE exported before the process starts."""
    env = clean_env({"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    env.pop("HF_HOME", None)
    check = ("from types import SimpleNamespace; from lerobot_mg.errors import ConfigError; "
             "from lerobot_mg.processors import check_tokenizers\n"
             "try:\n    check_tokenizers(SimpleNamespace(type='pi05'))\n"
             "except ConfigError as error:\n    print(error)")
    done = subprocess.run([PYTHON, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"policy.tokenizer_name='{PALIGEMMA_TOKENIZER}': is not in huggingface_hub's cache")
    assert done.stdout.count("\n") == 1 and f"hf download {PALIGEMMA_TOKENIZER} --include" in done.stdout
    assert not (tmp_path / "hub").exists() or list((tmp_path / "hub").iterdir()) == []


def test_a_cached_tokenizer_is_found_offline(offline_cache: Path, in_fixtures: Path) -> None:
    """A tokenizer in the cache's layout (models--<user>--<name>/refs/main -> snapshots/<commit>/) is used as it is;
    the preflight resolves every tokenizer a saved preprocessor names, and a new one's from the config."""
    commit = "0" * 40
    repo_dir = offline_cache / "models--someone--tiny-paligemma"
    shutil.copytree(FIXTURES / "pi0_tiny" / "tiny_tokenizer", repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    pi0 = SimpleNamespace(type="pi0", tokenizer_name="someone/tiny-paligemma")
    assert check_tokenizers(pi0) == [repo_dir / "snapshots" / commit]
    step = TokenizerStep("someone/tiny-paligemma", max_length=16)
    local = TokenizerStep("pi0_tiny/tiny_tokenizer", max_length=16)
    batch = {"task": ["pick up the red cube\n"]}
    assert torch.equal(step(batch)[LANGUAGE_TOKENS], local(batch)[LANGUAGE_TOKENS])
    assert step.get_config()["tokenizer_name"] == "someone/tiny-paligemma"  # saved as given, not the cache path
    assert check_tokenizers(None, _pretrained("smolvla_tiny")) == [Path("smolvla_tiny/tiny_vlm")]
    assert check_tokenizers(SimpleNamespace(type="act")) == []
    weights_only = offline_cache / "models--someone--weights-only"  # a snapshot of the repo without its tokenizer
    (weights_only / "snapshots" / commit).mkdir(parents=True)
    (weights_only / "snapshots" / commit / "config.json").write_text("{}")
    shutil.copytree(repo_dir / "refs", weights_only / "refs")
    with pytest.raises(ConfigError, match=r"^policy.tokenizer_name='someone/weights-only': is not in "
                                          r"huggingface_hub's cache, .* Fix: fetch it while online: hf download"):
        check_tokenizers(SimpleNamespace(type="pi05", tokenizer_name="someone/weights-only"))


def test_a_tokenizer_name_that_is_neither_a_folder_nor_a_repo_id_is_refused(offline_cache: Path) -> None:
    with pytest.raises(ConfigError, match=r"^policy.vlm_model_name='no_such_folder': is neither a directory nor a "
                                          r"Hub repo id"):
        resolve_tokenizer("no_such_folder", "policy.vlm_model_name")
