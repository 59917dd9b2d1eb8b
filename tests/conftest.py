import functools

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


@pytest.fixture(scope="session", autouse=True)
def one_timing_per_pass_size():
    """The benchmark times every pass size 9-15 times for its cost tables (a minute of float32
    passes on two cores); the tests read the tables' shape and use, not their precision, so
    here each size is timed once after a warm-up round."""
    from specdec.bench import batched, runner

    with pytest.MonkeyPatch.context() as mp:
        for module, name in ((runner, "forward_ms"), (batched, "batch_forward_ms")):
            mp.setattr(module, name, functools.partial(getattr(module, name), rounds=1, reps=1))
        yield
