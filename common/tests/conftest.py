def pytest_configure(config):
    # The marks every chapter's suite registers (pyproject.toml): coursekit.pytest_plugin, which
    # these tests import, uses them.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "sanitize: the small run the GPU pass puts under compute-sanitizer")
