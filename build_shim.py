"""Builds rustc10d's torch side, the shim, against one torch: the C++ that translates torch's
Backend and Work calls for the Rust core (cpp/) plus the C++ half of the cxx bridge, which
build.rs writes out with the core. One shim per torch release (major.minor), named
``shim_<major>_<minor>.so``; the package loads the one that matches the torch it runs with.

    python build_shim.py --sources DIR --core PATH --out DIR [--torch-python PYTHON] [--python-include DIR]

--torch-python: a Python whose torch to build against (default: this one); --python-include:
the headers of the Python the shim will run in (default: that Python's). setup.py calls
``build(...)``; scripts/build_wheels.sh calls it once per torch release for each Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# The torch APIs that differ across the supported releases (2.11 to 2.15): (feature, header
# under torch/csrc/distributed/c10d, or a path from the include root where it starts with c10/,
# an identifier only that feature declares there).
# cpp/torch_compat.h turns each RUSTC10D_TORCH_HAS_<feature> into what the shim uses.
TORCH_FEATURES = [
    # Backend::registerCompletionHook and friends (2.15).
    ("COMPLETION_HOOKS", "Backend.hpp", "registerCompletionHook"),
    # Work::getCompletionKey (2.15).
    ("COMPLETION_KEY", "Work.hpp", "getCompletionKey"),
    # c10d::PreMulSumSupplement; before, NCCLPreMulSumSupplement.
    ("PREMUL_SUM_SUPPLEMENT", "Types.hpp", "PreMulSumSupplement"),
    # OpType::ALLGATHER_INTO_TENSOR_COALESCED and its reduce-scatter twin.
    ("TENSOR_COALESCED_OPTYPES", "Work.hpp", "ALLGATHER_INTO_TENSOR_COALESCED"),
    # Backend::gather_into_tensor.
    ("GATHER_INTO_TENSOR", "Backend.hpp", "gather_into_tensor"),
    # Backend::supportsReconfigure, get_reconfigure_handle, reconfigure (2.14).
    ("RECONFIGURE", "Backend.hpp", "get_reconfigure_handle"),
    # Backend::registerAbortHook and unregisterAbortHook (2.14).
    ("ABORT_HOOKS", "Backend.hpp", "registerAbortHook"),
    # Backend::supportsAbortHooks (2.15).
    ("ABORT_HOOKS_QUERY", "Backend.hpp", "supportsAbortHooks"),
    # Backend::getError and c10d::ErrorType (2.11 on: torch's default raises).
    ("GET_ERROR", "Backend.hpp", "getError"),
    # DeviceGuardImplInterface::isStreamCapturing: whether a stream is being captured into a graph.
    ("STREAM_CAPTURE_QUERY", "c10/core/impl/DeviceGuardImplInterface.h", "isStreamCapturing"),
]

PROBE = r"""
import json, sys, sysconfig
try:
    import torch, torch.utils.cpp_extension as ext
except Exception as e:
    sys.exit(f"import torch failed: {e}")
print(json.dumps({"version": torch.__version__, "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "includes": ext.include_paths(), "libs": ext.library_paths(),
                  "python_include": sysconfig.get_paths()["include"]}))
"""


def declares(text: str, ident: str) -> bool:
    """Whether `ident` occurs in `text` as a whole identifier (not inside a longer one:
    `gather_into_tensor` is not `allgather_into_tensor`)."""
    def is_ident(c: str) -> bool:
        return c.isascii() and (c.isalnum() or c == "_")
    at = text.find(ident)
    while at >= 0:
        before = text[at - 1] if at > 0 else ""
        after = text[at + len(ident)] if at + len(ident) < len(text) else ""
        if not (before and is_ident(before)) and not (after and is_ident(after)):
            return True
        at = text.find(ident, at + 1)
    return False


def probe_features(includes: list[str]) -> dict[str, bool]:
    """Which of TORCH_FEATURES the torch headers declare (reading them is instant, where a
    compile per probe costs seconds of torch headers each)."""
    found = {}
    for feature, header, ident in TORCH_FEATURES:
        for inc in includes:
            path = Path(inc) / (header if header.startswith("c10/") else f"torch/csrc/distributed/c10d/{header}")
            if path.exists():
                found[feature] = declares(path.read_text(), ident)
                break
        else:
            raise SystemExit(f"rustc10d: torch has no header {header}; is it a torch built with distributed?")
    return found


def probe_torch(python: str) -> dict:
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"rustc10d: {python} has no usable torch ({out.stderr.strip()}). Install torch into that "
                         f"environment first (pip install torch), then build with `pip install --no-build-isolation .`")
    return json.loads(out.stdout.strip().splitlines()[-1])


def shim_name(torch_version: str) -> str:
    major, minor = torch_version.split("+")[0].split(".")[:2]
    return f"shim_{major}_{minor}.so"


def cxx_standard(torch_version: str) -> str:
    """The C++ standard torch's own extensions build with (torch.utils.cpp_extension): C++17 up to
    2.11, C++20 from 2.12. The same one also keeps the shim within manylinux_2_28: C++20 turns
    torch 2.11's inline `ostringstream::str()` into a call of GCC 11's `str() const &`
    (GLIBCXX_3.4.29, newer than glibc 2.28's systems carry)."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    return "-std=c++17" if (major, minor) < (2, 12) else "-std=c++20"


def build(sources: Path, core: Path, out_dir: Path, torch_python: str = sys.executable,
          python_include: str | None = None, verbose: bool = False, cache: Path | None = None) -> Path:
    """Compile and link the shim for torch_python's torch into out_dir (the package's _torch/),
    against `core`, the package's _native module; returns its path. With `cache`, a folder: a
    shim built before from the same sources, torch and flags is copied from there instead."""
    torch = probe_torch(torch_python)
    features = probe_features(torch["includes"])
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / shim_name(torch["version"])
    cxx = os.environ.get("CXX", "c++")
    flags = [cxx_standard(torch["version"]), "-O2", "-fPIC", "-g0", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={torch['abi']}", "-Wno-unused-parameter", "-Wno-deprecated-declarations",
             f"-I{sources / 'include'}", f"-I{python_include or torch['python_include']}",
             *(f"-I{inc}" for inc in torch["includes"]),
             *(f"-DRUSTC10D_TORCH_HAS_{f}={int(has)}" for f, has in features.items()),
             f"-DRUSTC10D_SHIM_TORCH_VERSION=\"{torch['version']}\"",
             "-DRUSTC10D_SHIM_TORCH_FEATURES=\"" + ",".join(f"{f.lower()}={int(h)}" for f, h in features.items()) + "\""]
    # What the core calls (the bridge's C++ half, cxx's runtime) keeps default visibility: the
    # core finds it at run time. The shim's own code stays hidden.
    units = [(sources / "bridge.cc", []), (sources / "cxx/src/cxx.cc", []),
             (sources / "cpp/backend.cc", ["-fvisibility=hidden"]), (sources / "cpp/completion.cc", ["-fvisibility=hidden"]),
             (sources / "cpp/glibc.cc", [])]
    key = hashlib.sha256(json.dumps([flags, core.name, torch]).encode())
    for path in sorted(p for p in sources.rglob("*") if p.is_file()):
        key.update(path.relative_to(sources).as_posix().encode() + b"\0" + path.read_bytes())
    cached = cache / f"{target.stem}-{key.hexdigest()[:16]}.so" if cache else None
    if cached and cached.exists():
        shutil.copy2(cached, target)
        return target
    objects = []
    for unit, extra in units:
        obj = out_dir / f"{target.stem}.{unit.stem}.o"
        cmd = [cxx, *flags, *extra, "-c", str(unit), "-o", str(obj)]
        if verbose:
            print(shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        objects.append(str(obj))
    lib_dir = torch["libs"][0]
    # The shim needs the core, by its file name, next to _torch/: loading the shim loads both, and
    # binds each one's calls into the other (the core's go through its GOT, so bound at load).
    # torch's libraries are found next to the package, where pip puts torch.
    link = [cxx, "-shared", "-o", str(target), *objects, f"-L{core.parent}", f"-l:{core.name}",
            f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch_python",
            "-Wl,--enable-new-dtags", "-Wl,-rpath,$ORIGIN/..:$ORIGIN/../../torch/lib"]
    if verbose:
        print(shlex.join(link), flush=True)
    subprocess.run(link, check=True)
    for obj in objects:
        os.unlink(obj)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target, cached)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=Path, required=True, help="what build.rs staged (RUSTC10D_SHIM_SOURCES)")
    parser.add_argument("--core", type=Path, required=True, help="the package's _native module")
    parser.add_argument("--out", type=Path, required=True, help="the package's _torch folder")
    parser.add_argument("--torch-python", default=sys.executable)
    parser.add_argument("--python-include", default=None)
    args = parser.parse_args()
    print(build(args.sources, args.core, args.out, args.torch_python, args.python_include, verbose=True))


if __name__ == "__main__":
    main()
