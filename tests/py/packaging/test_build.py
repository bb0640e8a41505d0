"""The pieces of the build that pick a torch's shim: build_shim.py's header probe and names, and
the package's choice at import (rustc10d._load). Pure functions: no build here."""

import sys

import harness

sys.path.insert(0, str(harness.REPO))
import build_shim  # noqa: E402


def test_a_feature_is_a_whole_identifier_in_the_header():
    assert build_shim.declares("virtual void gather_into_tensor(", "gather_into_tensor")
    assert build_shim.declares("gather_into_tensor", "gather_into_tensor")
    # allgather_into_tensor is another API: it must not count.
    assert not build_shim.declares("allgather_into_tensor(x); gather_into_tensor_x", "gather_into_tensor")
    assert build_shim.declares("allgather_into_tensor(x);\n  gather_into_tensor(y)", "gather_into_tensor")


def test_a_shim_is_named_and_found_by_the_torch_release():
    from rustc10d import _load
    for version in ("2.15.0", "2.15.0+cu132", "2.15.3+cpu"):
        assert build_shim.shim_name(version) == "shim_2_15.so"
        assert _load.release(version) == "2.15"
        assert _load.shim_path(version).name == "shim_2_15.so"
    assert _load.release("2.11.0a0+git1234") == "2.11"
    assert _load.shim_path("2.9.1").name == "shim_2_9.so"
