import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def torch_threads(request):
    """Two shared cores: more intra-op threads than a test needs only oversubscribe them.
    A module sets TORCH_THREADS (default 1: the tiny models gain nothing from more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(getattr(request.module, "TORCH_THREADS", 1))
    yield
    torch.set_num_threads(before)
