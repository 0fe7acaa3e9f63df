"""The simulation extra: checking it is installed and choosing a headless OpenGL backend.

MuJoCo and dm_control read ``MUJOCO_GL`` once, when they are first imported, so the backend is
chosen before any sim module is imported and every import of them goes through
:func:`require_sim`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

SIM_INSTALL_HINT = "pip install 'lerobot_mg[sim]'  (or `make setup`, which installs every extra)"

# Tried in order when MUJOCO_GL is unset: EGL renders on a GPU or on Mesa's software rasteriser,
# OSMesa is the older software-only fallback.
_HEADLESS_BACKENDS = ("egl", "osmesa")
_NO_RENDERING = "disable"
_PROBE_CODE = "import mujoco; c = mujoco.GLContext(16, 16); c.make_current(); c.free()"


SIM_PACKAGES = ("mujoco", "dm_control", "gym_aloha")


def missing_sim_packages() -> list[str]:
    """The packages of the simulation extra that are not installed (none imported)."""
    return [name for name in SIM_PACKAGES if importlib.util.find_spec(name) is None]


def require_sim() -> None:
    """Raises a clear ImportError when the simulation extra is missing; picks the GL backend.

    Call before importing mujoco, dm_control or gym_aloha.
    """
    missing = missing_sim_packages()
    if missing:
        raise ImportError(
            f"lerobot_mg[sim]: the simulation needs the packages {missing}, which are not installed. Fix: "
            f"{SIM_INSTALL_HINT}"
        )
    chosen = configure_headless_rendering()
    if chosen is not None:  # the process's choice stays in its environment (code that restores os.environ)
        os.environ.setdefault("MUJOCO_GL", chosen)


@functools.cache
def configure_headless_rendering() -> str | None:
    """Sets ``MUJOCO_GL`` to the first headless backend that can create a context; returns the backend in force
    (None: mujoco was imported before any was chosen).

    A value the user set is kept. Each candidate is probed in a subprocess because a failed GL
    initialisation cannot be undone in this one. When nothing renders, rendering is disabled so
    that state-only generation and evaluation still work; :func:`assert_rendering_available`
    then explains what to install.
    """
    if "MUJOCO_GL" in os.environ:
        return os.environ["MUJOCO_GL"]
    if "mujoco" in sys.modules:
        # Too late to choose: mujoco has already read the (unset) variable.
        return None
    for backend in _HEADLESS_BACKENDS:
        if _backend_works(backend):
            os.environ["MUJOCO_GL"] = backend
            return backend
    os.environ["MUJOCO_GL"] = _NO_RENDERING
    return _NO_RENDERING


def assert_rendering_available() -> None:
    if "MUJOCO_GL" not in os.environ and configure_headless_rendering() is not None:
        # This process chose a backend earlier; code that restores os.environ (a finished run) removed it.
        os.environ["MUJOCO_GL"] = configure_headless_rendering()  # type: ignore[assignment]
    backend = os.environ.get("MUJOCO_GL", "")
    if not backend:
        raise RuntimeError(
            "mujoco was imported before lerobot_mg.sim could choose a headless OpenGL backend, so it "
            "fell back to GLFW, which needs a display. Set MUJOCO_GL=egl (or osmesa) in the environment, "
            "or import lerobot_mg.sim's functions before importing mujoco."
        )
    if backend.lower() in ("disable", "disabled", "off", "false", "0"):
        raise RuntimeError(
            f"Rendering camera images needs a headless OpenGL backend, but MUJOCO_GL={backend!r}: neither "
            f"EGL nor OSMesa could create a context here. Install Mesa's EGL (Debian: `apt-get install "
            f"libegl1 libgl1-mesa-dri`) or OSMesa (`apt-get install libosmesa6`), or generate/evaluate "
            f"without images."
        )


def _backend_works(backend: str) -> bool:
    env = {**os.environ, "MUJOCO_GL": backend}
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE], env=env, capture_output=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0
