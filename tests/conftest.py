import pytest
import torch.distributed as dist

from tests.distributed import close_pools


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_pools()


@pytest.fixture
def group(tmp_path):
    """The default group of this process (one rank), for the test only."""
    assert not dist.is_initialized(), "a default process group was left behind by an earlier test"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
