"""The privacy tests run tiny models, where a second intra-op thread only adds synchronisation: on a
shared machine it made a 4 s test take 40 s. One thread per test, restored afterwards."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
