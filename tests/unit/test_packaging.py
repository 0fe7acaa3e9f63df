"""The installed package works without the checkout, and importing the config stays light.

A wheel is built from this tree and installed into a fresh virtual environment that sees the running one's
dependencies (torch included) through a ``.pth`` line, so nothing is downloaded (pip runs with ``--no-index``).
The running environment's editable install is not visible there: its finder is set up by a ``.pth`` file of
that site-packages, and a folder a ``.pth`` line adds is not scanned for ``.pth`` files. From another directory,
that venv's ``lerobot-mg-train experiment=pusht_debug steps=2`` then trains on the presets and the PushT slice
shipped in the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.launch_utils import PUSHT_SLICE, PYTHON, REPO, clean_env, kill_tree

# What the build reads: the project metadata (its readme included), the package and conf/.
BUILD_INPUTS = ("pyproject.toml", "README.md", "lerobot_mg", "conf")
PLUGINS = REPO / "lerobot_mg" / "launch" / "plugins"
LOCK = REPO / "requirements" / "lock.txt"
# The packages only a CUDA build of torch needs: the lock is installed beside either build, so it holds none of them.
CUDA_ONLY = re.compile(r"^(nvidia-|cuda-|triton$)")


def _run(argv: list[str | Path], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([str(arg) for arg in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"watchdog: {argv} ran over {timeout} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree, built from a copy (a build writes build/ and an .egg-info next to its sources)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    build = _run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "-w", base / "dist", source], env=clean_env())
    assert build.returncode == 0, build.stdout[-6000:]
    (built,) = (base / "dist").glob("lerobot_mg-*.whl")
    return built


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


@pytest.mark.packaging
def test_the_wheel_holds_every_module_the_presets_and_the_pusht_slice(wheel: Path) -> None:
    expected = set()
    for path in (REPO / "lerobot_mg").rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        expected.add(f"hydra_plugins/{path.relative_to(PLUGINS / 'hydra_plugins').as_posix()}"
                     if path.is_relative_to(PLUGINS) else path.relative_to(REPO).as_posix())
    expected |= {f"lerobot_mg/conf/{path.relative_to(REPO / 'conf').as_posix()}"
                 for path in (REPO / "conf").rglob("*.yaml")}
    expected |= {path.relative_to(REPO).as_posix() for path in PUSHT_SLICE.rglob("*") if path.is_file()}
    missing = sorted(expected - _wheel_files(wheel))
    packages = sorted({name.rpartition("/")[0].replace("/", ".") for name in missing if name.endswith(".py")})
    assert not missing, f"not in the wheel: {missing}; add the packages {packages} to [tool.setuptools] packages"


@pytest.mark.packaging
def test_a_wheel_installed_elsewhere_trains_the_debug_preset_from_another_directory(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    made = _run([PYTHON, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stdout
    python = bin_dir / Path(sys.executable).name
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # Without this checkout on PYTHONPATH: pip would find its lerobot_mg.egg-info there, call the wheel installed
    # already and copy nothing.
    env = {key: value for key, value in clean_env().items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    installed = _run([PYTHON, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
                     env=env)
    assert installed.returncode == 0, installed.stdout[-6000:]
    # The dependencies: the running environment's site-packages, after the venv's own (where the wheel went).
    dependencies = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "running_environment.pth").write_text("".join(f"{path}\n" for path in dependencies))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([python, "-c", "import lerobot_mg, lerobot_mg.config.loading as loading; "
                                "print(lerobot_mg.__file__); print(loading.CONF_DIR)"], env=env, cwd=elsewhere)
    assert where.returncode == 0, where.stdout
    package_file, conf_dir = (Path(line) for line in where.stdout.splitlines())
    assert package_file == site / "lerobot_mg" / "__init__.py"  # the wheel's copy, not this checkout
    assert conf_dir == site / "lerobot_mg" / "conf"
    # The tiny VLA presets' tokenizers (and SmolVLM config) ship with the wheel: they resolve from any directory.
    shipped = site / "lerobot_mg" / "data" / "vla_tiny"
    assert {path.relative_to(shipped).as_posix() for path in shipped.rglob("*.json")} >= {
        "paligemma/tokenizer.json", "smolvlm/tokenizer.json", "smolvlm/config.json"}

    help_page = _run([bin_dir / "lerobot-mg-train", "--help"], env=env, cwd=elsewhere)
    assert help_page.returncode == 0 and help_page.stdout.startswith("lerobot-mg-train: "), help_page.stdout[-6000:]
    assert "\npolicy: act, diffusion, pi0, pi05, smolvla\n" in help_page.stdout  # the presets of the wheel's conf/

    train = _run([bin_dir / "lerobot-mg-train", "experiment=pusht_debug", "steps=2", "logging.wandb.mode=disabled",
                  "logging.progress_bar=false"], env=env, cwd=elsewhere)
    assert train.returncode == 0, train.stdout[-6000:]
    (run_dir,) = (elsewhere / "outputs" / "train").glob("*/*")
    assert (run_dir / "checkpoints" / "last" / "pretrained_model" / "model.safetensors").is_file()
    saved = json.loads((run_dir / "train_config.json").read_text())
    assert saved["steps"] == 2
    assert Path(saved["dataset"]["root"]) == site / "lerobot_mg" / "data" / "pusht_image_slice"


def test_importing_the_config_does_not_import_the_models_torch_pyarrow_or_pyav() -> None:
    """The config layer loads no model code, torch, pyarrow or PyAV: those come with the modules that use them."""
    probe = _run([PYTHON, "-c", "import json, sys; import lerobot_mg.config; print(json.dumps(sorted(sys.modules)))"],
                 env=clean_env(), cwd=REPO)
    assert probe.returncode == 0, probe.stdout
    modules = json.loads(probe.stdout.splitlines()[-1])
    heavy = sorted({name.split(".")[0] for name in modules if name.split(".")[0] in ("torch", "pyarrow", "av")}
                   | {name for name in modules if re.match(r"lerobot_mg\.policies\..*modeling", name)})
    ours = [name for name in modules if name.startswith("lerobot_mg")]
    assert not heavy, f"import lerobot_mg.config imports {heavy}, through the lerobot_mg modules {ours}"


def _lock_pins() -> dict[str, tuple[Version, int]]:
    """requirements/lock.txt as {canonical name: (pinned version, number of hashes)}."""
    pins: dict[str, tuple[Version, int]] = {}
    name = None
    for line in LOCK.read_text().splitlines():
        pinned = re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", line)
        if pinned:
            name = canonicalize_name(pinned[1])
            pins[name] = (Version(pinned[2]), 0)
        elif name is not None and line.strip().startswith("--hash=sha256:"):
            pins[name] = (pins[name][0], pins[name][1] + 1)
    return pins


def _makefile_variable(name: str) -> str:
    (value,) = re.findall(rf"^{name} \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    return value


def test_the_lock_pins_every_requirement_within_its_range_with_hashes_and_leaves_torch_out() -> None:
    """What `make setup` installs (pip --no-deps --require-hashes): a pin with hashes for every dependency and
    extra of pyproject.toml, inside its range (a range changed without `make lock` fails here), no torch and
    nothing only the CUDA build of torch needs; the Makefile's torch is inside torch's range."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [Requirement(text) for text in
                    [*project["dependencies"], *(text for extra in ("sim", "dev", "trackio") for text in extras[extra])]]
    pins = _lock_pins()
    assert len(pins) > len(requirements)  # their dependencies too
    outside = {str(req): pins.get(canonicalize_name(req.name)) for req in requirements if req.name != "torch"
               and (canonicalize_name(req.name) not in pins
                    or not req.specifier.contains(pins[canonicalize_name(req.name)][0], prereleases=True))}
    assert not outside, f"requirements/lock.txt does not pin these within their range (run make lock): {outside}"
    assert not [name for name, (_, hashes) in pins.items() if hashes == 0]
    assert not [name for name in pins if name == "torch" or CUDA_ONLY.match(name)]
    (torch_requirement,) = [req for req in requirements if req.name == "torch"]
    assert Version(_makefile_variable("TORCH_VERSION")) in torch_requirement.specifier
