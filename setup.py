"""Builds rustc10d: the Rust core (once, for the Python that builds it, with no torch in it) and
the shim, rustc10d's torch side (build_shim.py), for the torch installed in this environment:

    pip install --no-build-isolation .

torch must already be installed, and the build must see it, so build isolation stays off. A
Other torches: RUSTC10D_SHIM_TORCH_PYTHONS names the Pythons of environments that have them,
separated by ":"; "none" builds no shim (scripts/build_wheels.sh adds them to the wheel after,
one torch at a time, with build_shim.py, so that only one extra torch need be on disk at once).
RUSTC10D_FEATURES adds cargo features to the core, separated by spaces: scripts/test.sh builds
with "lock-levels", the lock-order checker (src/locks.rs), for the whole suite.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools_rust import Binding, RustExtension

sys.path.insert(0, str(Path(__file__).parent))
import build_shim  # noqa: E402


class BuildShims(Command):
    """After the core: a shim per torch (this environment's, or RUSTC10D_SHIM_TORCH_PYTHONS's),
    into the package's _torch folder, linked against the core just built."""

    description = "build rustc10d's torch side for each torch"
    user_options = []

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        package = Path(self.build_lib) / "rustc10d"
        cores = sorted(package.glob("_native*.so"))
        if len(cores) != 1:
            raise SystemExit(f"rustc10d: expected one core module in {package}, found {cores}")
        meta = json.loads(subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                                         capture_output=True, text=True, check=True).stdout)
        sources = Path(meta["target_directory"]) / "release" / "rustc10d-shim-sources"
        if not (sources / "bridge.cc").exists():
            raise SystemExit(f"rustc10d: the core's build left no shim sources in {sources}: remove "
                             f"{meta['target_directory']} and build again")
        # A shim left from an earlier build may not match the core built now.
        for stale in (package / "_torch").glob("shim_*.so"):
            stale.unlink()
        listed = os.environ.get("RUSTC10D_SHIM_TORCH_PYTHONS", "")
        if listed == "none":
            return
        pythons = [p for p in listed.split(":") if p] or [sys.executable]
        python_include = sysconfig.get_paths()["include"]  # the Python the wheel is for
        for python in pythons:
            shim = build_shim.build(sources, cores[0], package / "_torch", python, python_include,
                                    cache=Path(meta["target_directory"]) / "release" / "rustc10d-shims")
            print(f"rustc10d: built {shim} against the torch of {python}", flush=True)


build.sub_commands.append(("build_shims", None))

setup(
    name="rustc10d",
    version="0.1.0",
    description="A PyTorch distributed (c10d) backend written in Rust",
    package_dir={"": "python"},
    packages=["rustc10d"],
    rust_extensions=[
        # Always optimised, editable installs too: a debug build reduces 10-50x slower.
        RustExtension(
            "rustc10d._native",
            binding=Binding.PyO3,
            features=["extension", *os.environ.get("RUSTC10D_FEATURES", "").split()],
            py_limited_api=False,
            debug=False,
        )
    ],
    cmdclass={"build_shims": BuildShims},
    entry_points={"torch.distributed.backends": ["rustc10d = rustc10d:register"]},
    install_requires=["torch>=2.11,<2.16"],
    extras_require={"test": ["pytest", "pytest-timeout", "numpy"], "bench": ["matplotlib"]},
    python_requires=">=3.10",
    zip_safe=False,
)
