"""dataset.repo_id and policy.repo_id: LeRobot's cache, the once-per-node download, the model card and the upload.

Nothing here reaches the network: datasets are laid out in a temporary ``HF_LEROBOT_HOME``; huggingface_hub's calls are
replaced by fakes where a download or an upload must succeed, and pointed at a closed local port where one must fail.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lerobot_mg.checkpoint import hub as checkpoint_hub
from lerobot_mg.checkpoint.hub import UploadFailed, push_pretrained, upload_later_command
from lerobot_mg.config import register_configs
from lerobot_mg.config.choices import DatasetName
from lerobot_mg.config.loading import CONF_DIR, override_keys, run_config
from lerobot_mg.config.schema import DatasetConfig
from lerobot_mg.data import hub
from lerobot_mg.data.hub import INCOMPLETE_MARKER, lerobot_home, resolve_dataset
from lerobot_mg.errors import ConfigError
from tests.hub_server import FakeHub, Repo
from tests.launch_utils import (
    PUSHT_SLICE,
    PYTHON,
    REPO,
    TINY_RUN,
    TRAIN_SCRIPT,
    clean_env,
    free_port,
    kill_tree,
)


def _run_config(typed: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=typed)
    return run_config(composed, frozenset(override_keys(typed)))


def lay_out(home: Path, repo_id: str) -> Path:
    """A LeRobot v3.0 dataset in LeRobot's cache layout: <HF_LEROBOT_HOME>/<repo_id>."""
    shutil.copytree(PUSHT_SLICE, home / repo_id)
    return home / repo_id


# --- dataset.repo_id --------------------------------------------------------------------------------------------

def test_the_guide_flag_replaces_the_default_dataset_unless_a_root_is_typed() -> None:
    cfg = _run_config(["dataset.repo_id=me/my_dataset"])
    assert (cfg.dataset.name, cfg.dataset.root, cfg.dataset.repo_id) == (DatasetName.lerobot, None, "me/my_dataset")
    typed = _run_config(["dataset.repo_id=me/my_dataset", f"dataset.root={PUSHT_SLICE}"])
    assert typed.dataset.root == str(PUSHT_SLICE)
    # A preset that names its own directory keeps it in the config; the start then refuses the pair (test_dataset_hub).
    assert _run_config(["experiment=pusht_debug", "dataset.repo_id=me/x"]).dataset.root == str(PUSHT_SLICE)
    assert _run_config([]).dataset.name == DatasetName.embedded  # no repo id: the embedded default as before


def test_lerobot_home_is_lerobots_own_cache() -> None:
    assert lerobot_home({"HF_LEROBOT_HOME": "/data/lr"}) == Path("/data/lr")
    assert lerobot_home({"HF_HOME": "/data/hf"}) == Path("/data/hf/lerobot")
    assert lerobot_home({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/lerobot")
    assert lerobot_home({}) == Path.home() / ".cache" / "huggingface" / "lerobot"


def test_a_cached_dataset_is_found_offline_and_a_typed_root_wins(tmp_path: Path) -> None:
    cached = lay_out(tmp_path / "lr", "me/ds")
    env = {"HF_LEROBOT_HOME": str(tmp_path / "lr"), "HF_HUB_OFFLINE": "1"}
    source = resolve_dataset(DatasetConfig(name=DatasetName.lerobot, repo_id="me/ds"), env)
    assert (source.root, source.repo_id, source.revision, source.how) == (str(cached), "me/ds", None, "cache")
    # A root of the user's own beside the repo id is read as that repo's copy (LeRobot's --dataset.root).
    mine = shutil.copytree(PUSHT_SLICE, tmp_path / "mine")
    given = resolve_dataset(DatasetConfig(name=DatasetName.lerobot, root=str(mine), repo_id="me/ds"), env)
    assert (given.root, given.how) == (str(mine), "root")


def test_offline_and_not_cached_is_one_line_naming_the_repo_where_it_looked_and_the_fetch(tmp_path: Path) -> None:
    home = tmp_path / "lr"
    partial = lay_out(home, "me/partial")
    (partial / INCOMPLETE_MARKER).touch()  # a download killed half-way is not a cached copy
    for repo_id in ("me/missing", "me/partial"):
        with pytest.raises(ConfigError) as error:
            resolve_dataset(DatasetConfig(name=DatasetName.lerobot, repo_id=repo_id, revision="v3.0"),
                            {"HF_LEROBOT_HOME": str(home), "HF_HUB_OFFLINE": "1"})
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith(f"dataset.repo_id='{repo_id}': is not in LeRobot's cache ({home / repo_id}), and "
                                  "HF_HUB_OFFLINE=1 forbids downloading it. Fix: fetch it while online: "
                                  f"hf download {repo_id} --repo-type dataset --revision v3.0 --local-dir "
                                  f"{home / repo_id}"), message
    assert not (home / "me" / "missing").exists()


def test_the_ranks_of_a_node_download_once_and_all_read_the_same_copy(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str | None, Path]] = []

    class FakeApi:
        def dataset_info(self, repo_id: str, revision: str | None = None):
            return type("Info", (), {"sha": "0123abcd"})()

    def fake_snapshot_download(repo_id: str, *, repo_type: str, revision: str, local_dir: Path) -> str:
        calls.append((repo_id, repo_type, revision, Path(local_dir)))
        time.sleep(0.5)  # the others reach the lock meanwhile
        shutil.copytree(PUSHT_SLICE, local_dir, dirs_exist_ok=True)
        return str(local_dir)

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    env = {"HF_LEROBOT_HOME": str(tmp_path / "lr")}
    cfg = DatasetConfig(name=DatasetName.lerobot, repo_id="me/ds", revision="main")
    sources: list = []
    ranks = [threading.Thread(target=lambda: sources.append(resolve_dataset(cfg, env))) for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=60)
    assert calls == [("me/ds", "dataset", "0123abcd", tmp_path / "lr" / "me" / "ds")]
    assert sorted(source.how for source in sources) == ["cache", "cache", "download"]
    assert {source.root for source in sources} == {str(tmp_path / "lr" / "me" / "ds")}
    assert next(s for s in sources if s.how == "download").commit == "0123abcd"  # the commit, for the run facts
    assert not (tmp_path / "lr" / "me" / "ds" / INCOMPLETE_MARKER).exists()
    # A later start finds the copy and records the same commit (a resume sees no change of revision).
    assert resolve_dataset(cfg, env).commit == "0123abcd"


def test_policy_path_as_a_hub_repo_id_reads_huggingface_hubs_cache_offline(tmp_path: Path) -> None:
    """``policy.path=<user>/<name>``, as LeRobot accepts it: the snapshot huggingface_hub cached, found offline."""
    repo = tmp_path / "hf" / "hub" / "models--me--base"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = ("from lerobot_mg.data.hub import resolve_policy_path as r\n"
              "print(r('me/base'))\n"
              "try:\n    r('me/absent')\nexcept Exception as e:\n    print(e)\n")
    env = clean_env({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    done = subprocess.run([PYTHON, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    found, refused = done.stdout.splitlines()[:2]
    assert found == str(repo / "snapshots" / commit), done.stderr[-2000:]
    assert refused.startswith("policy.path='me/absent': is no directory, and as a Hub model repo it could not be "
                              "had (LocalEntryNotFoundError"), refused
    assert refused.endswith("Fix: policy.path=<run>/checkpoints/<step or last>/pretrained_model, or fetch it while "
                            "online: hf download me/absent")


# --- the upload -------------------------------------------------------------------------------------------------

def _pretrained(tmp_path: Path) -> Path:
    pretrained = tmp_path / "run" / "checkpoints" / "000002" / "pretrained_model"
    (pretrained / "pytorch_model_fsdp_0").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "train_config.json", "README.md", "pytorch_model_fsdp_0/x"):
        (pretrained / name).write_text("{}" if name.endswith(".json") else name)
    return pretrained


def test_a_failed_upload_keeps_the_directory_and_names_it_and_the_command(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pretrained = _pretrained(tmp_path)
    before = {path: path.read_bytes() for path in pretrained.rglob("*") if path.is_file() and path.name != "README.md"}

    class DownApi:
        def create_repo(self, *args, **kwargs):
            raise ConnectionError("Connection refused")

    monkeypatch.setattr(checkpoint_hub, "HfApi", DownApi)
    with pytest.raises(UploadFailed) as error:
        push_pretrained(pretrained, "me/pol", "upload")
    message = str(error.value)
    assert message.startswith(f"policy.repo_id=me/pol: the upload of {pretrained} failed (ConnectionError: "
                              "Connection refused)"), message
    assert message.endswith(f"kept at {pretrained.parent}. Fix: upload it later with "
                            f"{upload_later_command(pretrained.parent, 'me/pol')}")
    # Nothing changed but the card, whose metadata the upload completed first (the text it had is kept).
    assert {path: path.read_bytes() for path in pretrained.rglob("*") if path.is_file() and path.name != "README.md"
            } == before
    card = (pretrained / "README.md").read_text()
    assert card.startswith("---\n") and "license: apache-2.0\n" in card and card.endswith("---\nREADME.md")


def _convert_and_push(hub: FakeHub, step_dir: Path, repo_id: str, *extra: str) -> subprocess.CompletedProcess:
    """``lerobot-mg-convert-dcp checkpoint_dir=<step_dir> push_to_hub=<repo_id> ...`` as a user runs it, online
    against the local Hub."""
    env = clean_env({**hub.env(), "HF_HUB_OFFLINE": "0"})
    return subprocess.run([PYTHON, "-c", "from lerobot_mg.checkpoint.convert import main; raise SystemExit(main())",
                           f"checkpoint_dir={step_dir}", f"push_to_hub={repo_id}", *extra], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_converter_publishes_as_lerobot_does_private_with_license_and_tags(tmp_path: Path) -> None:
    """A checkpoint without shards is published as it is (the command a run prints after a failed upload): the
    repo private as its config.json's ``private`` says, the card's metadata with its license and tags beside
    LeRobot's own (robotics, lerobot, the policy type), and the same card on disk as on the Hub. ``private=``,
    ``license=`` and ``tags=`` on the command line take the place of the checkpoint's."""
    pretrained = _pretrained(tmp_path)
    shutil.rmtree(pretrained / "pytorch_model_fsdp_0")
    (pretrained / "README.md").unlink()  # a run that did not publish wrote no card
    (pretrained / "config.json").write_text(json.dumps({"type": "act", "private": True, "license": "mit",
                                                        "tags": ["so101", "pick"]}))
    (pretrained / "train_config.json").write_text(json.dumps({"dataset": {"repo_id": "me/ds"}}))
    with FakeHub() as hub:
        done = _convert_and_push(hub, pretrained.parent, "me/pol")
        assert done.returncode == 0, done.stderr[-3000:]
        repo = hub.repos["me/pol"]
        assert repo.private and repo.created_with["visibility"] == "private"
        assert sorted(repo.files) == ["README.md", "config.json", "model.safetensors", "train_config.json"]
        assert repo.commits == ["Upload 000002 (lerobot_mg)"]
        card = (pretrained / "README.md").read_text()
        assert repo.files["README.md"] == card.encode()
        assert card.startswith("---\nlibrary_name: lerobot\ndatasets:\n- me/ds\nlicense: mit\npipeline_tag: robotics\n"
                               "tags:\n- robotics\n- lerobot\n- act\n- so101\n- pick\n---\n\n# me/pol\n"), card

        done = _convert_and_push(hub, pretrained.parent, "me/open", "private=false", "license=cc-by-4.0", "tags=[x]")
        assert done.returncode == 0, done.stderr[-3000:]
        assert not hub.repos["me/open"].private and hub.repos["me/open"].created_with["visibility"] == "public"
        card = hub.repos["me/open"].files["README.md"].decode()
        assert "license: cc-by-4.0\n" in card and "- pick\n- x\n" in card  # the card's own tags kept, x added

        hub.repos["me/public"] = Repo(private=False, created_with={})  # made public by someone, earlier
        done = _convert_and_push(hub, pretrained.parent, "me/public")
        assert done.returncode == 2 and hub.repos["me/public"].files == {}, done.stderr[-3000:]
        (line,) = [line for line in done.stderr.splitlines() if "error:" in line]
        assert line == (f"lerobot-mg-convert-dcp: error: push_to_hub=me/public: the repo exists and is public, and "
                        f"private=true: nothing was uploaded. The checkpoint is complete and kept at {pretrained.parent}."
                        f" Fix: make the repo private on the Hub, then upload it later with "
                        f"{upload_later_command(pretrained.parent, 'me/public')}")


# --- a real run ---------------------------------------------------------------------------------------------------

def test_a_run_whose_upload_fails_keeps_its_checkpoint_and_exits_non_zero_with_the_command(tmp_path: Path) -> None:
    """Online as far as the run can tell (a token, no HF_HUB_OFFLINE), but the Hub is a closed local port: the run
    trains, saves, writes the card, fails the upload with one line, and the printed command is the same upload."""
    output_dir = tmp_path / "run"
    env = clean_env({"HF_TOKEN": "hf_not_a_real_token", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                     "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp_path / "hf")})
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HYDRA_FULL_ERROR")  # what a user sees
    proc = subprocess.Popen([PYTHON, str(TRAIN_SCRIPT), *TINY_RUN, "steps=2", "policy.repo_id=me/pol",
                             f"output_dir={output_dir}"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError("watchdog: the run ran over 300 s") from None
    assert proc.returncode == 2, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if "lerobot-mg-train: error:" in line]
    step_dir = output_dir / "checkpoints" / "000002"
    command = upload_later_command(step_dir, "me/pol")
    assert line.startswith(f"lerobot-mg-train: error: policy.repo_id=me/pol: the upload of {step_dir / 'pretrained_model'} "
                           "failed ("), line
    assert line.endswith(f"kept at {step_dir}. Fix: upload it later with {command}"), line
    pretrained = step_dir / "pretrained_model"
    assert (output_dir / "checkpoints" / "last").resolve() == step_dir.resolve()
    assert (pretrained / "model.safetensors").is_file() and (step_dir / "training_state" / "training_step.json").is_file()
    card = (pretrained / "README.md").read_text()
    assert "# me/pol" in card and "| steps | 2 loop steps" in card and "| final loss |" in card
    assert json.loads((pretrained / "config.json").read_text())["repo_id"] == "me/pol"

    again = subprocess.run([PYTHON, "-c", "from lerobot_mg.checkpoint.convert import main; raise SystemExit(main())",
                            *command.split()[1:]], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and f"push_to_hub=me/pol: the upload of {pretrained} failed (" in again.stderr, (
        again.stderr[-3000:])
