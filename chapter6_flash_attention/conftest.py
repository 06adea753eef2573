import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
pytest_plugins = ["coursekit.pytest_plugin"]


def pytest_report_header(config):
    import flash_attention
    from coursekit.pytest_plugin import extension_header
    return extension_header(flash_attention)
