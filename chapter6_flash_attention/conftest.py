import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
pytest_plugins = ["coursekit.pytest_plugin"]


def pytest_report_header(config):
    import flash_attention
    from coursekit.pytest_plugin import extension_header
    return extension_header(flash_attention)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one CPU thread for a module's tests: the end-to-end scripts' quick models
    (train_tiny_gpt.py, generate_paged.py) are so small that one thread beats two on a 2-core machine
    (both scripts' main() say so too)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def seeded_python_random(_seed):
    """Python's random seeded like torch (the plugin's _seed: per test id), for the tests that draw
    with it too: the serving half's block tables and radix trees (test_paged_*.py use it for every
    test)."""
    import random

    import torch
    random.seed(torch.initial_seed())
