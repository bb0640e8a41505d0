"""Shared fixtures.

    .venv/bin/python -m pytest                                 # against rustc10d
    RUSTC10D_TEST_BACKEND=gloo .venv/bin/python -m pytest      # the same checks against Gloo

Most tests only look up one check's result from a job that runs every check at once per world
size (harness.Job, checks.py), because starting ranks costs seconds each.
"""

import pytest

import checks
import harness


def pytest_report_header(config):
    return f"backend under test: {checks.BACKEND} (RUSTC10D_TEST_BACKEND)"


@pytest.fixture(scope="session")
def jobs(tmp_path_factory) -> harness.JobCache:
    return harness.JobCache(tmp_path_factory)


@pytest.fixture
def make_hosts():
    """make_hosts(count, **Hosts options): a test bed of rustc10d.testbed, torn down after the
    test; skips the test where namespaces cannot be made."""
    from rustc10d import testbed

    beds = []

    def make(count: int, **options) -> testbed.Hosts:
        bed = testbed.Hosts(count, **options)
        try:
            bed.start()
        except testbed.TestbedUnavailable as e:
            pytest.skip(f"no network namespaces here: {e}")
        beds.append(bed)
        return bed

    yield make
    for bed in beds:
        bed.close()
