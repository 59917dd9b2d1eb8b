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
    """The benchmark times every pass size 15 times for its cost table (a minute of float32
    passes on two cores); the tests read the table's shape and use, not its precision, so
    here each size is timed once after a warm-up round."""
    from specdec.bench import runner

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "forward_ms", functools.partial(runner.forward_ms, rounds=1, reps=1))
        yield
