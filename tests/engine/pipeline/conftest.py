"""One intra-op thread for the split tests: their stage threads already run side by side, and on a 2-core box
torch's own thread pool on top of them spins more than it computes."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
