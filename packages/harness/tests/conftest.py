import pytest

# edge_home (a private EDGE_INFER_HOME) and smollm2 (the default model, pulled into it)
pytest_plugins = ["edge_infer.testing"]


@pytest.fixture(scope="session")
def edge_home(edge_home):
    """The engine's private EDGE_INFER_HOME, with a private benchmark lock in it."""
    # not imported at the top: pytest_plugins must import the module first, to rewrite its asserts
    from edge_infer.testing import environ

    # Tests time nothing that is reported: a private lock keeps them from waiting on (or
    # blocking) a real benchmark; that benchmark's guard still sees them as load.
    with environ(EDGE_HARNESS_LOCK=str(edge_home / "bench.lock")):
        yield edge_home


@pytest.fixture(scope="session")
def test_core() -> int:
    """The core the load tests may saturate for a few seconds: the last physical one."""
    from edge_infer.api import physical_cores

    return physical_cores()[-1]
