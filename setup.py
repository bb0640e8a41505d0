"""Builds rustc10d against the torch installed in this environment.

torch must already be installed, and the build must see it, so install with
build isolation off:  pip install --no-build-isolation .
"""

from setuptools import setup
from setuptools_rust import Binding, RustExtension

setup(
    name="rustc10d",
    version="0.1.0",
    description="A PyTorch distributed (c10d) backend written in Rust",
    package_dir={"": "python"},
    packages=["rustc10d"],
    rust_extensions=[
        # Always optimised, editable installs too: a debug build reduces 10-50x slower.
        RustExtension(
            "rustc10d._native", binding=Binding.PyO3, features=["extension"], py_limited_api=False, debug=False
        )
    ],
    entry_points={"torch.distributed.backends": ["rustc10d = rustc10d:register"]},
    install_requires=["torch"],
    extras_require={"test": ["pytest", "pytest-timeout", "numpy"], "bench": ["matplotlib"]},
    python_requires=">=3.10",
    zip_safe=False,
)
