"""Fixtures and helpers every chapter's tests share; a chapter's conftest.py enables them with
`pytest_plugins = ["coursekit.pytest_plugin"]`."""
import zlib

import pytest
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dtype_id(dtype):
    return str(dtype).split(".")[-1]


def shape_id(shape):
    return "x".join(map(str, shape))


def extension_header(package):
    """pytest's report header: which build of the chapter's extension the tests run against."""
    ext = package.EXTENSION
    return [f"{package.__name__} extension: route={ext['route']} {ext.get('so_path', '')}",
            f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"]


def poison_allocator(like):
    """Leave a NaN-filled block of the output's size in the allocator, so the op's output is
    most likely carved from it (always on CUDA, whose caching allocator hands the block
    straight back): any element the kernel fails to write then shows up as NaN."""
    block = torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)
    del block


def launched_kernels(call, namespace):
    """Run call() under the profiler and return the names of the CUDA kernels it launched from
    `namespace` (demangled, template arguments included): how a test sees which rung a
    version=None dispatch really ran."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = call()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if namespace in e.name]


def floor(dtype):
    """An absolute error every comparison allows near zero. float16's subnormals (spacing
    2^-24) are what long softmax rows produce (outputs ~1e-6) and the kernels round into them
    correctly, so one subnormal step; for the others, values below the smallest normal may be
    flushed to zero on the GPU (FTZ), so the smallest normal."""
    return 2.0**-24 if dtype == torch.float16 else torch.finfo(dtype).smallest_normal


def assert_within(out, expected, bound, what=""):
    """|out - expected| <= bound element by element (bound broadcasts); NaN must meet NaN. The
    failure names how many elements are out and the first of them."""
    assert out.shape == expected.shape, (what, tuple(out.shape), tuple(expected.shape))
    out64, exp64 = out.double(), expected.double()
    bound = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64, device=out.device), exp64.shape)
    ok = ((out64 - exp64).abs() <= bound) | (out64.isnan() & exp64.isnan())
    if not bool(ok.all()):
        at = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} elements out of bounds; first at {at}: "
                             f"got {out64[at].item()!r}, expected {exp64[at].item()!r}, "
                             f"allowed {bound[at].item():.3g}")


def offset_copy(t, offset):
    """t's values in a fresh tensor that starts `offset` elements into its storage: a view whose
    data pointer is misaligned for offset > 0 (what a slice of a user's buffer hands a kernel)."""
    return torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)[offset:].view(t.shape).copy_(t)


def _capture(step):
    """(graph, captured, expected): step() once eagerly on a side stream (the warm-up a capture
    needs: lazy initialisation and allocator growth happen outside it), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        expected = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured, expected


def capture_and_replay(step):
    """(captured, expected): step() once eagerly on a side stream, then captured into a CUDA graph
    and replayed once. A kernel that syncs, allocates outside the graph's pool or ignores the
    current stream fails the capture or gives other results than the eager call."""
    graph, captured, expected = _capture(step)
    graph.replay()
    torch.cuda.synchronize()
    return captured, expected


def replayed_outputs(step, replays):
    """[outputs after replay 1, ..., after replay `replays`] of step() captured into one CUDA
    graph, each a tuple of clones (the graph's outputs are overwritten by the next replay). For
    kernels that keep state across launches, counters a graph node must zero before each one: a
    replay that finds them as the last one left them answers differently."""
    graph, captured, _ = _capture(step)
    outputs = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        outputs.append(tuple(t.clone() for t in captured))
    return outputs


def assert_misplaced(call, message, *inputs):
    """call(*inputs) puts a tensor where a number goes or the other way round: it must raise the
    TypeError of the Python API's argument check (coursekit.loader.check_arguments) matching
    message, with no tensor's values in it."""
    with pytest.raises(TypeError, match=message) as raised:
        call(*inputs)
    assert "tensor([" not in str(raised.value), f"a tensor's values in the message: {raised.value}"


def require_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda":
        require_cuda()
    return request.param


def pytest_collection_modifyitems(config, items):
    """Without a CUDA GPU, the cases of the `device` fixture's "cuda" parameter skipped by a mark
    at collection, with the reason the fixture would give: the same skip, decided before any
    fixture is set up (~1 ms a case less; a run has ~10,000 of them on a CPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs in every test, reproducible per test id: crc32, not hash(), whose
    # salt changes with every Python process.
    seed = zlib.crc32(request.node.nodeid.encode())
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        # The CPU generator alone, the only one a machine without CUDA draws from: there
        # torch.manual_seed also queues a lazy seeding of CUDA, XPU and MTIA, each with the
        # formatted stack of the call (pytest's is ~40 frames deep), which cost ~1.5 ms a test
        # and a queue that grows with every test of the run. The same inputs either way.
        torch.default_generator.manual_seed(seed)


def ptx_kernels(cu_file, out_dir, arch="sm_80"):
    """{mangled kernel name: PTX body} of a chapter's .cu file, compiled with nvcc -ptx as the
    build would (the chapter folder and common/include on the include path); skips the test
    when nvcc is not installed. What tests read to check the instructions a kernel compiles to."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    cu_file = Path(cu_file).resolve()
    ptx = Path(out_dir) / f"{cu_file.stem}.ptx"
    subprocess.run([nvcc, "-ptx", "-std=c++17", f"-arch={arch}", "-I", str(cu_file.parent),
                    "-I", str(cu_file.parents[1] / "common" / "include"), "-o", str(ptx),
                    str(cu_file)], check=True)
    entries = re.split(r"\.entry ", ptx.read_text())[1:]
    return {body.split("(", 1)[0]: body for body in entries}


class FakeNcu:
    """subprocess.run as coursekit.ncu calls it, for tests of a profile script on a machine
    without ncu: `ncu --version`, then ncu over the workload, which rejects the metrics in
    `rejects` with an ==ERROR== line (or fails with `error`), else writes `plan` where --plan
    says (as the workload would) and prints `csv_text`. Every command it saw is in .commands."""

    def __init__(self, csv_text, plan=None, rejects=(), error=None):
        self.csv, self.plan, self.rejects, self.error, self.commands = csv_text, plan, set(rejects), error, []

    def __call__(self, cmd, capture_output=True, text=True):
        import json
        import types
        from pathlib import Path

        self.commands.append(cmd)
        if "--version" in cmd:
            return types.SimpleNamespace(returncode=0, stdout="Version 2025.3.0.0 (build 1)\n", stderr="")
        if self.error:
            return types.SimpleNamespace(returncode=1, stdout="", stderr=self.error)
        bad = [m for m in cmd[cmd.index("--metrics") + 1].split(",") if m in self.rejects]
        if bad:
            return types.SimpleNamespace(returncode=1, stdout="", stderr=f"==ERROR== Failed to find metric {bad[0]}\n")
        if "--plan" in cmd:
            Path(cmd[cmd.index("--plan") + 1]).write_text(json.dumps(self.plan))
        return types.SimpleNamespace(returncode=0, stdout=self.csv, stderr="")
