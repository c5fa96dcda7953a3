"""One intra-op thread for the in-process model runs of the link tests (the workers get OMP_NUM_THREADS=1)."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
