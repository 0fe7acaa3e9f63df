"""Files from someone else are data, bounded and contained.

- Strings of a resumed train_config.json are never resolved: a planted ``${oc.env:HF_TOKEN}`` stays that text in a
  real resumed run, and the token appears in no file the run writes (nor an unset variable fails the start).
- Paths stored in files stay inside the folder they came with (:func:`lerobot_mg.safe_paths.contained`): a DCP
  shard's ``relative_path``, a processor step's ``state_file``, a dataset's ``data_path`` / ``video_path``. An
  absolute path, ``..``, a symlink out of the folder and a non-regular file are refused in one line naming the file
  and the key; a Hub cache snapshot's links into its blobs are not.
- A ``.distcp`` item's archive is read only when every entry is stored uncompressed within the item: a deflate
  bomb, a compressed entry and a size beyond the item are refused before anything is inflated, by the pre-resume
  check, the loader and the converter.
- Our DCP writer pickles no pathlib class, and a .metadata pickled as Python 3.13 writes one (``pathlib._local``)
  loads on any Python the project claims.

Core dependencies only (torch, safetensors, omegaconf, ...), so the file runs on any Python the project claims.
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import os
import pathlib
import pickle
import re
import shutil
import struct
import sys
import types
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import lerobot_mg
from lerobot_mg.checkpoint import convert
from lerobot_mg.checkpoint.dcp_io import load_dcp, save_dcp
from lerobot_mg.checkpoint.resume import check_resumable
from lerobot_mg.checkpoint.unpickle import METADATA_GLOBALS, read_dcp_metadata
from lerobot_mg.config.literal import literal_values
from lerobot_mg.config.loading import load_train_config_json
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.errors import ConfigError
from lerobot_mg.processors import PolicyProcessorPipeline, make_processors
from lerobot_mg.safe_paths import RefusedFile, UnsafePath, contained
from tests.data_aids import TinyDataset
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.unit.test_dcp_safety import globals_in, sharded_step_dir
from tests.unit.test_processors import INPUTS, OUTPUTS, STATS, config_with

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SECRET = "hf_SECRET_planted_4c1d9e"


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# --- interpolations --------------------------------------------------------------------------------------------------


def test_every_string_reads_back_as_the_same_text_through_omegaconf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every string over the characters of OmegaConf's grammar (up to 4 of them), and the shapes a planted value
    takes, reads back from a config as itself: nothing resolved, nothing unescaped, nothing refused."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    strings = ["".join(chars) for length in range(1, 5) for chars in itertools.product("\\${}a:", repeat=length)]
    strings += ["${oc.env:HF_TOKEN}", "x${oc.env:HF_TOKEN}y", "\\${oc.env:HF_TOKEN}", "\\\\${oc.env:HF_TOKEN}",
                "${oc.env:LEROBOT_MG_UNSET_FOR_TEST}", "${oc.decode:'[1,2]'}", "${now:%Y}", "${", "}${{", "a\\"]
    data = {"text": strings, "nested": {"token": "${oc.env:HF_TOKEN}"}, "number": 3, "flag": True, "none": None}
    config = OmegaConf.create(literal_values(data, "f.json"))
    assert OmegaConf.to_container(config, resolve=True) == data


def test_the_missing_value_marker_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps({"policy": {"type": "act", "tags": ["a", "???"]}}))
    with pytest.raises(ConfigError) as error:
        load_train_config_json(path)
    assert _one_line(error).startswith(f"{path}: policy.tags[1]='???' is OmegaConf's marker of a missing value")


def test_a_resumed_train_config_keeps_planted_interpolations_literal_and_leaks_nothing(tmp_path: Path) -> None:
    """A real run resumed from a train_config.json whose strings name the environment: the run goes on (an unset
    variable fails nothing), its files hold the planted text as it was typed, and the token (set in the resumed
    run's environment) is in none of the files the run wrote (checkpoint, ledger, wandb's offline files, the
    dataset cache), nor in its output."""
    dataset = shutil.copytree(PUSHT_SLICE, tmp_path / "dataset")  # its frame cache is written there: checked too
    run_dir = tmp_path / "run"
    run_train([*TINY_RUN, "steps=2", "checkpoint.save_freq=1", "log_freq=1", f"dataset.root={dataset}",
               f"output_dir={run_dir}"])
    config = run_dir / "checkpoints" / "000001" / "pretrained_model" / "train_config.json"
    planted = json.loads(config.read_text())
    planted["job_name"] = "${oc.env:HF_TOKEN}"
    planted["logging"]["wandb"]["group"] = "g-${oc.env:HF_TOKEN}"
    planted["policy"]["license"] = "${oc.env:HF_TOKEN}"
    planted["policy"]["tags"] = ["\\${oc.env:HF_TOKEN}", "${oc.env:HF_TOKEN}", "${oc.env:LEROBOT_MG_UNSET_FOR_TEST}"]
    config.write_text(json.dumps(planted))

    proc = run_train(["resume=true", f"config_path={config}", "logging.wandb.mode=offline"],
                     env={"HF_TOKEN": SECRET, "WANDB_SILENT": "true"})
    assert SECRET not in proc.stdout
    resumed = run_dir / "checkpoints" / "000002" / "pretrained_model"
    saved = json.loads((resumed / "train_config.json").read_text())
    assert saved["job_name"] == "${oc.env:HF_TOKEN}" and saved["logging"]["wandb"]["group"] == "g-${oc.env:HF_TOKEN}"
    policy = json.loads((resumed / "config.json").read_text())
    assert policy["license"] == "${oc.env:HF_TOKEN}"
    assert policy["tags"] == ["\\${oc.env:HF_TOKEN}", "${oc.env:HF_TOKEN}", "${oc.env:LEROBOT_MG_UNSET_FOR_TEST}"]
    assert list(run_dir.glob("wandb/offline-run-*")), "wandb wrote nothing: the check below would miss its files"
    written = [path for path in tmp_path.rglob("*") if path.is_file() and not path.is_symlink()]
    assert len(written) > 20
    assert [path for path in written if SECRET.encode() in path.read_bytes()] == []


# --- paths stored in files -------------------------------------------------------------------------------------------


def _refusal(source: Path, key: str, stored: str, problem: str) -> str:
    return rf"^{re.escape(f'{source}: {key}={stored!r} {problem}')}: a path read from a file must name a regular file " \
           r"inside [^\n]*, so nothing was read from it\. Fix: [^\n]*$"


def test_contained_keeps_paths_inside_their_root_and_says_why_not(tmp_path: Path) -> None:
    root, source = tmp_path / "root", tmp_path / "root" / "manifest.json"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "file").write_text("x")
    (tmp_path / "outside").write_text("secret")
    (root / "inner_link").symlink_to(root / "sub" / "file")
    (root / "outer_link").symlink_to(tmp_path / "outside")
    (root / "dangling_out").symlink_to(tmp_path / "nowhere")
    os.mkfifo(root / "fifo")
    # Accepted: a file, a link inside, a path that does not exist yet (the caller reports it missing).
    assert contained(root, "sub/file", source, "k") == root / "sub" / "file"
    assert contained(root, "inner_link", source, "k") == root / "inner_link"
    assert contained(root, "sub/absent", source, "k") == root / "sub" / "absent"
    refused = {
        "/etc/passwd": "is an absolute path",
        "\\\\server\\share": "is an absolute path",
        "C:\\Windows\\win.ini": "is an absolute path",
        "../outside": "climbs out of its folder with '..'",
        "sub/../../outside": "climbs out of its folder with '..'",
        "sub\\..\\..\\outside": "climbs out of its folder with '..'",
        "outer_link": f"leads out of {root} through a symlink (to {tmp_path / 'outside'})",
        "dangling_out": f"leads out of {root} through a symlink (to {tmp_path / 'nowhere'})",
        "fifo": "is not a regular file",
        "sub": "is not a regular file",
        "": "is not a relative file path",
    }
    for stored, problem in refused.items():
        with pytest.raises(UnsafePath, match=_refusal(source, "steps[0].state_file", stored, problem)):
            contained(root, stored, source, "steps[0].state_file")
    with pytest.raises(UnsafePath, match=r"key=\['a'\] is not a relative file path"):
        contained(root, ["a"], source, "key")


def test_a_hub_cache_snapshot_links_into_its_own_blobs_only(tmp_path: Path) -> None:
    """huggingface_hub's cache keeps a snapshot's files as links into the repo's blobs/: inside, for the check. A
    link from a snapshot into another repo's blobs is not."""
    repo = tmp_path / "hub" / "models--user--policy"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text("{}")
    (snapshot / "policy_preprocessor.json").symlink_to(Path("../../blobs/f00d"))
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    (other / "beef").write_text("{}")
    (snapshot / "stolen.json").symlink_to(other / "beef")
    linked = snapshot / "policy_preprocessor.json"
    assert contained(snapshot, "policy_preprocessor.json", snapshot / "m.json", "k") == linked
    with pytest.raises(UnsafePath, match="through a symlink"):
        contained(snapshot, "stolen.json", snapshot / "m.json", "k")


def _saved_pipeline(directory: Path) -> tuple[Path, int]:
    """The preprocessor of a real policy config saved in ``directory``: its manifest and the index of the step with
    a state file."""
    pre, _ = make_processors(config_with(), INPUTS, OUTPUTS, STATS)
    pre.save_pretrained(directory)
    manifest = directory / "policy_preprocessor.json"
    steps = json.loads(manifest.read_text())["steps"]
    return manifest, next(index for index, step in enumerate(steps) if "state_file" in step)


def _set_state_file(manifest: Path, index: int, value: str) -> None:
    data = json.loads(manifest.read_text())
    data["steps"][index]["state_file"] = value
    manifest.write_text(json.dumps(data))


def test_a_processor_state_file_stays_in_its_directory(tmp_path: Path) -> None:
    directory = tmp_path / "pretrained_model"
    manifest, index = _saved_pipeline(directory)
    state_file = json.loads(manifest.read_text())["steps"][index]["state_file"]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(directory / state_file, outside)
    (directory / "link_out.safetensors").symlink_to(outside)
    os.mkfifo(directory / "fifo.safetensors")  # would block the reader forever
    key = f"steps[{index}].state_file"
    cases = {
        str(outside): "is an absolute path",
        "../elsewhere.safetensors": "climbs out of its folder with '..'",
        "link_out.safetensors": f"leads out of {directory} through a symlink (to {outside})",
        "fifo.safetensors": "is not a regular file",
    }
    for stored, problem in cases.items():
        _set_state_file(manifest, index, stored)
        with pytest.raises(UnsafePath, match=_refusal(manifest, key, stored, problem)):
            PolicyProcessorPipeline.from_pretrained(directory, "policy_preprocessor")
    _set_state_file(manifest, index, state_file)  # the control: the file it wrote loads
    PolicyProcessorPipeline.from_pretrained(directory, "policy_preprocessor")


def test_strings_of_a_processor_file_are_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A processor's config is never resolved: a planted interpolation is a name like any other, and saving the
    pipeline again writes the text, not the token."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    manifest, _ = _saved_pipeline(tmp_path / "a")
    data = json.loads(manifest.read_text())
    rename = next(step for step in data["steps"] if step["registry_name"] == "rename_observations_processor")
    rename["config"]["rename_map"] = {"observation.state": "${oc.env:HF_TOKEN}"}
    manifest.write_text(json.dumps(data))
    pipeline = PolicyProcessorPipeline.from_pretrained(tmp_path / "a", "policy_preprocessor")
    pipeline.save_pretrained(tmp_path / "b")
    text = (tmp_path / "b" / "policy_preprocessor.json").read_text()
    assert '"observation.state": "${oc.env:HF_TOKEN}"' in text and SECRET not in text


def _edit_info(root: Path, **values: object) -> None:
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info.update(values)
    info_path.write_text(json.dumps(info, indent=4))


def test_a_dataset_reads_its_files_from_inside_its_root(tiny_dataset: TinyDataset, tmp_path: Path) -> None:
    root = tiny_dataset.root
    info = root / "meta" / "info.json"
    original = json.loads(info.read_text())
    data_file = "data/chunk-000/file-000.parquet"
    video_key = next(name for name, feature in original["features"].items() if feature["dtype"] == "video")
    assert LeRobotDataset(root).num_frames == 22  # the control: as written

    cases = {
        ("data_path", "/tmp/{chunk_index}/{file_index}.parquet"): ("/tmp/0/0.parquet", "is an absolute path"),
        ("data_path", "../other/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"):
            ("../other/chunk-000/file-000.parquet", "climbs out of its folder with '..'"),
        ("video_path", "videos/{video_key}/../../../x/{chunk_index}-{file_index}.mp4"):
            (f"videos/{video_key}/../../../x/0-0.mp4", "climbs out of its folder with '..'"),
    }
    for (key, template), (stored, problem) in cases.items():
        _edit_info(root, **{key: template})
        with pytest.raises(UnsafePath, match=_refusal(info, key, stored, problem)):
            LeRobotDataset(root)
        _edit_info(root, **{key: original.get(key)})

    # A template may hold its fields only, a number with a small width: no attribute lookups, no gigabyte widths.
    for template, field in [("data/{chunk_index.__class__}/{file_index}.parquet", "{chunk_index.__class__}"),
                            ("data/{chunk_index:999999999d}/{file_index}.parquet", "{chunk_index:999999999d}"),
                            ("data/{chunk_index!r}/{file_index}.parquet", "{chunk_index!r}"),
                            ("data/{}/{file_index}.parquet", "{}"),
                            ("data/{video_key}/{file_index}.parquet", "{video_key}")]:
        _edit_info(root, data_path=template)
        with pytest.raises(ConfigError) as error:
            LeRobotDataset(root)
        assert _one_line(error).startswith(f"{info}: data_path={template!r} has the field {field}; a path template")
    _edit_info(root, data_path=original["data_path"])

    # A data file that is a link out of the root.
    outside = tmp_path / "elsewhere.parquet"
    shutil.move(root / data_file, outside)
    (root / data_file).symlink_to(outside)
    with pytest.raises(UnsafePath, match=_refusal(info, "data_path", data_file, f"leads out of {root} through a "
                                                  f"symlink (to {outside})")):
        LeRobotDataset(root)


# --- .distcp items ---------------------------------------------------------------------------------------------------


def _largest_item(dcp_dir: Path, kind: type) -> tuple[Path, int, int, str]:
    """(shard file, offset, length, key) of the largest item of ``kind`` (tensor or bytes) of ``dcp_dir``."""
    metadata = read_dcp_metadata(dcp_dir)
    index, info = max(((index, info) for index, info in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[index.fqn], kind)), key=lambda entry: entry[1].length)
    return dcp_dir / info.relative_path, info.offset, info.length, index.fqn


def _plant_archive(dcp_dir: Path, kind: type, build: object) -> tuple[Path, str]:
    """Replace the largest item of ``kind`` by ``build(its archive bytes)`` (zero-padded to its length)."""
    path, offset, length, key = _largest_item(dcp_dir, kind)
    with open(path, "r+b") as file:
        file.seek(offset)
        archive = file.read(length)
        planted = build(archive)  # type: ignore[operator]
        assert len(planted) <= length, (len(planted), length)
        file.seek(offset)
        file.write(planted.ljust(length, b"\0"))
    return path, key


def _recompressed(archive: bytes, bomb_bytes: int = 0) -> bytes:
    """``archive`` with every entry deflated; ``bomb_bytes`` > 0: the tensor's storage record replaced by that many
    zeros (a kilobyte or two that inflate a thousand-fold)."""
    out = io.BytesIO()
    with (zipfile.ZipFile(io.BytesIO(archive)) as source,
          zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target):
        for info in source.infolist():
            data = bytes(bomb_bytes) if bomb_bytes and info.filename.endswith("/data/0") else source.read(info)
            target.writestr(info.filename, data)
    return out.getvalue()


def _oversized(archive: bytes) -> bytes:
    """``archive`` whose data.pkl entry claims 2 GiB in the zip directory (a stored entry, as torch writes it)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as source:
        name = next(info.filename for info in source.infolist() if info.filename.endswith("/data.pkl")).encode()
    at = archive.index(b"PK\x01\x02")  # the central directory's entries, to the one of data.pkl
    while archive[at + 46: at + 46 + len(name)] != name:
        at = archive.index(b"PK\x01\x02", at + 4)
    patched = bytearray(archive)
    struct.pack_into("<II", patched, at + 20, 2**31, 2**31)  # compressed and uncompressed sizes
    return bytes(patched)


@pytest.fixture(scope="module")
def pristine_step_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_step_dir(tmp_path_factory.mktemp("untrusted"))


def _step_dir(pristine: Path, tmp_path: Path) -> Path:
    return shutil.copytree(pristine, tmp_path / pristine.name)


def _model_state(dcp_dir: Path) -> dict:
    return {k: torch.zeros(v.size, dtype=v.properties.dtype)
            for k, v in convert.dcp_tensor_specs(read_dcp_metadata(dcp_dir)).items()}


@pytest.mark.parametrize("plant", ["compressed", "bomb", "oversized"])
def test_an_archive_entry_that_would_inflate_is_refused_before_inflating(plant: str, pristine_step_dir: Path,
                                                                         tmp_path: Path) -> None:
    step_dir = _step_dir(pristine_step_dir, tmp_path)
    dcp_dir = step_dir / "pretrained_model" / "pytorch_model_fsdp_0"
    build = {"compressed": _recompressed, "bomb": lambda archive: _recompressed(archive, bomb_bytes=2**20),
             "oversized": _oversized}[plant]
    path, key = _plant_archive(dcp_dir, TensorStorageMetadata, build)
    if plant == "bomb":
        with zipfile.ZipFile(io.BytesIO(_item_bytes(dcp_dir, TensorStorageMetadata))) as planted:
            assert max(info.file_size / info.compress_size for info in planted.infolist()) > 500
    problem = (r"claims 2,147,483,648 bytes from byte [\d,]+, beyond the item's [\d,]+ bytes" if plant == "oversized"
               else r"is compressed \(zip method 8\)")
    message = (rf"^{re.escape(f'{path}: item {key!r}: its archive entry ')}'[^']*/data\.pkl' {problem}; torch stores "
               r"every entry of a checkpoint item uncompressed within the item, so nothing of it was inflated or read\. "
               r"Fix: use a checkpoint from a source you trust$")
    inflations = []
    real_decompressobj = zipfile.zlib.decompressobj

    def counted(*args: object, **kwargs: object) -> object:
        inflations.append(args)
        return real_decompressobj(*args, **kwargs)

    with mock.patch.object(zipfile.zlib, "decompressobj", counted):
        with pytest.raises(RefusedFile, match=message):  # the pre-resume check
            check_resumable(step_dir)
        with pytest.raises(RefusedFile, match=message):  # the loader
            load_dcp(_model_state(dcp_dir), dcp_dir, no_dist=True)
        with pytest.raises(RefusedFile, match=message):  # the converter
            convert.convert_checkpoint(step_dir)
    assert inflations == []


def test_a_compressed_byte_item_is_refused_before_torch_inflates_it(pristine_step_dir: Path, tmp_path: Path) -> None:
    """torch.load inflates a deflated entry (its reader is C++: the refusal has to come first)."""
    step_dir = _step_dir(pristine_step_dir, tmp_path)
    dcp_dir = step_dir / "training_state" / "optimizer_0"
    path, key = _plant_archive(dcp_dir, BytesStorageMetadata, _recompressed)
    with zipfile.ZipFile(io.BytesIO(_item_bytes(dcp_dir, BytesStorageMetadata))) as planted:
        assert {info.compress_type for info in planted.infolist()} == {zipfile.ZIP_DEFLATED}
    message = rf"^{re.escape(f'{path}: item {key!r}: its archive entry ')}'[^']*' is compressed \(zip method 8\); "
    with pytest.raises(RefusedFile, match=message):
        check_resumable(step_dir)
    metadata = read_dcp_metadata(dcp_dir)
    state = {k: 0 for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    with pytest.raises(RefusedFile, match=message):
        load_dcp(state, dcp_dir, no_dist=True)


def _item_bytes(dcp_dir: Path, kind: type) -> bytes:
    path, offset, length, _ = _largest_item(dcp_dir, kind)
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length)


def _rewrite_relative_paths(dcp_dir: Path, new_path: str) -> None:
    """Point every storage record of ``dcp_dir``'s .metadata at ``new_path`` (a trusted re-pickle of our own)."""
    metadata = read_dcp_metadata(dcp_dir)
    metadata.storage_data = {index: type(info)(new_path, info.offset, info.length, info.transform_descriptors)
                             for index, info in metadata.storage_data.items()}
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["absolute", "parent", "symlink"])
def test_a_shard_path_out_of_the_checkpoint_is_refused(where: str, pristine_step_dir: Path, tmp_path: Path) -> None:
    step_dir = _step_dir(pristine_step_dir, tmp_path)
    dcp_dir = step_dir / "pretrained_model" / "pytorch_model_fsdp_0"
    (shard,) = {info.relative_path for info in read_dcp_metadata(dcp_dir).storage_data.values()}
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(dcp_dir / shard, outside)
    if where == "absolute":
        stored, problem = str(outside), "is an absolute path"
        _rewrite_relative_paths(dcp_dir, stored)
    elif where == "parent":
        stored, problem = "../../../elsewhere.distcp", "climbs out of its folder with '..'"
        _rewrite_relative_paths(dcp_dir, stored)
    else:
        (dcp_dir / shard).unlink()
        (dcp_dir / shard).symlink_to(outside)
        stored, problem = shard, f"leads out of {dcp_dir} through a symlink (to {outside})"
    message = _refusal(dcp_dir / ".metadata", "@KEY@", stored, problem).replace(
        re.escape("@KEY@"), r"storage_data\['[\w.]+'\]\.relative_path")  # the first item that names the shard
    with pytest.raises(UnsafePath, match=message):
        check_resumable(step_dir)
    with pytest.raises(UnsafePath, match=message):
        load_dcp(_model_state(dcp_dir), dcp_dir, no_dist=True)
    with pytest.raises(UnsafePath, match=message):
        convert.convert_checkpoint(step_dir)


def test_a_shard_that_links_inside_the_checkpoint_loads(pristine_step_dir: Path, tmp_path: Path) -> None:
    step_dir = _step_dir(pristine_step_dir, tmp_path)
    dcp_dir = step_dir / "pretrained_model" / "pytorch_model_fsdp_0"
    expected = _model_state(dcp_dir)
    load_dcp(expected, dcp_dir, no_dist=True)
    (shard,) = {info.relative_path for info in read_dcp_metadata(dcp_dir).storage_data.values()}
    (dcp_dir / shard).rename(dcp_dir / "moved.bin")
    (dcp_dir / shard).symlink_to("moved.bin")
    check_resumable(step_dir)
    loaded = _model_state(dcp_dir)
    load_dcp(loaded, dcp_dir, no_dist=True)
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


# --- Python 3.13's pathlib -------------------------------------------------------------------------------------------

# pickle.dumps(pathlib.PosixPath("/runs/a/pytorch_model_fsdp_0")) on CPython 3.13.0: pathlib's classes live in
# pathlib._local there, and a path pickles as its class and one string.
PY313_PICKLED_PATH = (b"\x80\x04\x95C\x00\x00\x00\x00\x00\x00\x00\x8c\x0epathlib._local\x94\x8c\tPosixPath\x94\x93\x94"
                      b"\x8c\x1c/runs/a/pytorch_model_fsdp_0\x94\x85\x94R\x94.")


def dumps_as_python_313(obj: object) -> bytes:
    """``obj`` pickled as CPython 3.13 pickles it (protocol 4, what DCP's writer uses there): on 3.13 itself by
    pickle, elsewhere with pathlib's classes written under their 3.13 names."""
    if sys.version_info >= (3, 13):
        return pickle.dumps(obj, protocol=4)
    local = types.ModuleType("pathlib._local")
    stand_ins = {}
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        stand_ins[cls] = type(cls.__name__, (), {"__module__": "pathlib._local"})
        setattr(local, cls.__name__, stand_ins[cls])

    class Pickler313(pickle.Pickler):
        def reducer_override(self, value: object) -> object:
            if isinstance(value, pathlib.PurePath):
                return stand_ins[type(value)], (str(value),)
            return NotImplemented

    buffer = io.BytesIO()
    with mock.patch.dict(sys.modules, {"pathlib._local": local}):
        Pickler313(buffer, protocol=4).dump(obj)
    return buffer.getvalue()


def test_the_3_13_pickle_is_python_3_13s() -> None:
    assert dumps_as_python_313(pathlib.PosixPath("/runs/a/pytorch_model_fsdp_0")) == PY313_PICKLED_PATH


def test_a_metadata_pickled_by_python_3_13_loads(tmp_path: Path) -> None:
    """A checkpoint saved on 3.13 by torch's writer given a Path (as this package's writer did): its .metadata names
    pathlib._local.PosixPath, which the allow-list reads on every Python."""
    torch.manual_seed(0)
    saved = {"weight": torch.randn(4, 3), "step": torch.tensor(2.0), "groups": [{"lr": 1e-3}]}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)  # torch's writer keeps the Path in StorageMeta
    metadata = FileSystemReader(tmp_path).read_metadata()  # our own file: torch's reader is fine here
    assert isinstance(metadata.storage_meta.checkpoint_id, pathlib.PurePath)
    pickled = dumps_as_python_313(metadata)
    assert b"\x8c\x0epathlib._local\x94\x8c\tPosixPath" in pickled
    (tmp_path / ".metadata").write_bytes(pickled)

    assert str(read_dcp_metadata(tmp_path).storage_meta.checkpoint_id) == str(tmp_path)
    loaded = {"weight": torch.zeros(4, 3), "step": torch.tensor(0.0), "groups": [{"lr": 0.0}]}
    load_dcp(loaded, tmp_path, no_dist=True)
    assert torch.equal(loaded["weight"], saved["weight"]) and loaded["step"] == 2 and loaded["groups"] == saved["groups"]


def test_our_writer_pickles_no_pathlib_class(tmp_path: Path) -> None:
    save_dcp({"weight": torch.ones(3), "groups": [{"lr": 1e-3}]}, tmp_path / "dcp", no_dist=True)
    assert b"pathlib" not in (tmp_path / "dcp" / ".metadata").read_bytes()
    assert {module for module, _ in globals_in(tmp_path / "dcp" / ".metadata")} <= {
        module for module, _ in METADATA_GLOBALS if not module.startswith("pathlib")}
    assert read_dcp_metadata(tmp_path / "dcp").storage_meta.checkpoint_id == str(tmp_path / "dcp")


_WRITERS = {"save", "async_save", "FileSystemWriter"}


def _dcp_writes(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that call torch's DCP writer: ``dcp.save``/``dcp.async_save`` or a ``FileSystemWriter``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            on_dcp = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "dcp"
            if (name in ("save", "async_save") and on_dcp) or name == "FileSystemWriter":
                lines.append(node.lineno)
    return lines


def test_every_dcp_write_goes_through_save_dcp() -> None:
    """Only dcp_io.save_dcp calls torch's DCP writer: every checkpoint the package writes records a str path."""
    package = Path(lerobot_mg.__file__).parent
    writes = {str(path.relative_to(package)): lines for path in sorted(package.rglob("*.py"))
              if (lines := _dcp_writes(ast.parse(path.read_text())))}
    assert list(writes) == ["checkpoint/dcp_io.py"] and len(writes["checkpoint/dcp_io.py"]) == 1, writes
    assert _dcp_writes(ast.parse("dcp.save(s, checkpoint_id=p)\nFileSystemWriter(p)\ndcp.async_save(s)")) == [1, 2, 3]
