import os

import pytest
import torch

# Tests compare numerics, not speed: keep compiles deterministic and the thread count fixed.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _fresh_counts():
    import mla_inductor

    mla_inductor.reset_counts()
    yield
