import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def edge_home(tmp_path_factory) -> Path:
    """A private EDGE_INFER_HOME (and benchmark lock) for the test session."""
    home = tmp_path_factory.mktemp("edge-home")
    saved = {k: os.environ.get(k) for k in ("EDGE_INFER_HOME", "EDGE_HARNESS_LOCK")}
    os.environ["EDGE_INFER_HOME"] = str(home)
    # Tests time nothing that is reported: a private lock keeps them from waiting on (or
    # blocking) a real benchmark; that benchmark's guard still sees them as load.
    os.environ["EDGE_HARNESS_LOCK"] = str(home / "bench.lock")
    yield home
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def smollm2(edge_home):
    from edge_infer.models.pull import pull

    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def test_core() -> int:
    """The core the load tests may saturate for a few seconds: the last physical one."""
    from edge_harness.isolation.topology import physical_cores

    return physical_cores()[-1]
