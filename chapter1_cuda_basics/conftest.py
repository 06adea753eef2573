import pytest
import torch


def pytest_report_header(config):
    import cuda_basics
    ext = cuda_basics.EXTENSION
    return [f"cuda_basics extension: route={ext['route']} {ext.get('so_path', '')}",
            f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs in every test, reproducible per test id.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
