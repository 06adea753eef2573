"""The debugging exercise (off_by_one.cu, debug_lab.py).

Without a GPU: the kernels compile for the course's archs and with the DEBUG=1 device flags, and
the assert that debug_lab.py times is really in the code (and gone with -DNDEBUG). On a GPU: the
fixed kernels are right and write nothing past the end, and the broken one still has the bug
the exercise is about, and still passes a plain comparison with PyTorch.
"""
import subprocess

import pytest

import debug_lab
from coursekit.pytest_plugin import require_cuda


def nvcc_or_skip():
    nvcc = debug_lab.cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    return nvcc


def compiles(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compiles_for_course_archs():
    compiles(debug_lab.nvcc_command(nvcc_or_skip()))


def test_compiles_with_debug_flags():
    # The nvcc flags `debug_lab.py gdb` builds with, -G included.
    nvcc_flags = debug_lab.flags("debug")[1]
    assert "-G" in nvcc_flags
    compiles(debug_lab.nvcc_command(nvcc_or_skip(), archs=("90",), extra=nvcc_flags))


def assert_calls(tmp_path, nvcc, extra):
    """{kernel entry: number of __assertfail calls in its PTX} for sm_80."""
    ptx = tmp_path / "off_by_one.ptx"
    compiles(debug_lab.nvcc_command(nvcc, archs=("80",), extra=extra, ptx_out=ptx))
    return {name: body.count("__assertfail") for name, body in debug_lab.ptx_entries(ptx.read_text()).items()}


def calls_in(calls, kernel):
    matching = [count for name, count in calls.items() if kernel in name]
    assert len(matching) == 1, (kernel, sorted(calls))
    return matching[0]


def test_assert_compiled_in_unless_ndebug(tmp_path):
    """debug_lab.py dsa times scale_bias_relu_asserted<false> against its -DNDEBUG build. The
    comparison means something only if the check survives the optimizer in the first and is
    gone in the second; the broken and fixed kernels carry no assert at all."""
    nvcc = nvcc_or_skip()
    live = assert_calls(tmp_path, nvcc, ())
    gone = assert_calls(tmp_path, nvcc, ("-DNDEBUG",))
    for kernel in ("scale_bias_relu_assertedILb0", "scale_bias_relu_assertedILb1"):
        assert calls_in(live, kernel) > 0, kernel
        assert calls_in(gone, kernel) == 0, kernel
    for kernel in ("scale_bias_relu_broken", "scale_bias_relu_fixed"):
        assert calls_in(live, kernel) == 0, kernel


@pytest.fixture(scope="module")
def release_op():
    require_cuda()
    return debug_lab.build_and_load("release")


# 0 launches nothing; 256 fills whole blocks; the rest leave spare threads in the last block,
# the ones the bug runs on; 1823 * 781 is many blocks with a ragged end.
SIZES = [0, 1, 31, 255, 256, 257, 1000, 1823 * 781]


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["fixed", "asserted"])
@pytest.mark.parametrize("n", SIZES)
def test_fixed_kernels(release_op, kernel, n):
    # y starts as CANARY, a value relu never returns: an element the kernel skipped fails the
    # comparison, and one it wrote past the end changes buf[n].
    matches, past_end = debug_lab.check_kernel(release_op, kernel, n, canary=True)
    assert matches
    assert past_end == debug_lab.CANARY


@pytest.mark.cuda
@pytest.mark.parametrize("n, spare_threads", [(1000, True), (257, True), (1, True), (1024, False)])
def test_broken_kernel_keeps_its_bug(release_op, n, spare_threads):
    """The exercise must stay broken: y matches PyTorch, and the first spare thread (there is
    one whenever n is not a multiple of 256) stores relu(0 * scale + bias) = BIAS into buf[n]."""
    matches, past_end = debug_lab.check_kernel(release_op, "broken", n, canary=True)
    assert matches
    assert past_end == (debug_lab.BIAS if spare_threads else debug_lab.CANARY)
