"""Loads rustc10d's two native parts: the Rust core (``_native``, built once per Python, with no
torch in it) and the shim for the torch installed now (``_torch/shim_<major>_<minor>.so``, one
per torch release; a source build has the one of the torch it was built with, a wheel has one
for every supported release). The shim calls into the core and the core into the shim."""

from __future__ import annotations

import ctypes
import importlib
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).parent


def release(version: str) -> str:
    """A torch version's release, major.minor: the C++ ABI a shim is built for."""
    return ".".join(version.split("+")[0].split(".")[:2])


def shim_path(version: str) -> Path:
    return HERE / "_torch" / f"shim_{release(version).replace('.', '_')}.so"


def shipped() -> list[str]:
    """The torch releases this install has a shim for."""
    found = (p.stem.removeprefix("shim_").replace("_", ".") for p in (HERE / "_torch").glob("shim_*.so"))
    return sorted(found, key=lambda r: tuple(map(int, r.split("."))))


def load(rebuild_hint: str) -> tuple[ModuleType, str, dict[str, bool]]:
    """(the core module, the torch version the shim was built against, the torch features it
    found); ImportError naming the installed torch and the supported ones where no shim fits."""
    path = shim_path(torch.__version__)
    if not path.exists():
        have = ", ".join(shipped()) or "none"
        raise ImportError(
            f"rustc10d has no build for torch {torch.__version__} (release {release(torch.__version__)}); "
            f"this install supports torch {have}. Install a torch of those, or a rustc10d for this torch "
            f"(from source: {rebuild_hint})")
    # The shim names the core as a library it needs: loading it loads both and binds each one's
    # calls into the other; the import then finds the core loaded.
    try:
        shim = ctypes.CDLL(str(path))
    except OSError as exc:  # a torch whose libraries differ from the release the shim was built for
        raise ImportError(f"rustc10d's build for torch {release(torch.__version__)} could not be loaded with "
                          f"torch {torch.__version__}: {exc}. Rebuild it against this torch: {rebuild_hint}") from exc
    native = importlib.import_module("._native", __package__)
    shim.rustc10d_shim_torch_version.restype = ctypes.c_char_p
    shim.rustc10d_shim_torch_features.restype = ctypes.c_char_p
    built = shim.rustc10d_shim_torch_version().decode()
    features = {}
    for pair in shim.rustc10d_shim_torch_features().decode().split(","):
        name, bit = pair.split("=")
        features[name] = bit == "1"
    return native, built, features
