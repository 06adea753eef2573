"""The fused op built against the LibTorch stable ABI (stable_ops.cpp, custom_ops_stable).

What this file holds the stable build to:
- the answers of eager PyTorch, and the very bits of route 2 (torch.ops.custom_ops, the same
  kernels through the ordinary C++ API), on irregular shapes in float32, float16 and bfloat16
  (float64 for gradcheck), on CPU and CUDA;
- gradients through the autograd formula registered in Python, and gradcheck;
- torch.library.opcheck and torch.compile(fullgraph=True), through the fakes registered in
  Python;
- misuse raising a RuntimeError that names the op, from the C++ checks and from the fakes;
- on CUDA: the current stream (CUDA graph capture) and the device guard;
- the claim itself, read from the built library's undefined dynamic symbols: what it needs
  from libtorch is C functions (the shim), no newer than its target torch.

Bounds: inputs keep |x * scale + bias| >= 0.25 (inputs()), so no rounding flips the sign of an
element and the ReLU's mask is that of the exact values. The kernels compute in float32
(float64 for float64) and round once to the dtype; each bound says why next to it.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import custom_ops_stable
from coursekit.pytest_plugin import assert_within, dtype_id, floor, require_cuda, shape_id

OPS = torch.ops.custom_ops_stable
SCALE = 0.75  # not a power of two: x * scale rounds
LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [(1,), (3,), (1, 1), (31, 33), (2, 3, 33), (97, 13), (255, 257), (1823, 781)]


def inputs(shape, dtype, device, margin=0.25):
    """x and bias with |x * SCALE + bias| >= margin everywhere, in dtype. Rounding x (|x| < 12)
    and bias (|bias| < 5) to bfloat16 moves x * SCALE + bias by < 0.05: no sign flips."""
    bias = torch.randn(shape[-1], dtype=torch.float64, device=device)
    z = torch.randn(shape, dtype=torch.float64, device=device)
    z = z + margin * z.sign()
    return ((z - bias) / SCALE).to(dtype), bias.to(dtype)


def eps(dtype):
    return torch.finfo(dtype).eps


def eps_acc(dtype):
    """eps of the type the kernels compute in: float32 for every dtype but float64."""
    return eps(torch.float64 if dtype == torch.float64 else torch.float32)


def reference(x, bias):
    return torch.relu(x.double() * SCALE + bias.double())


def forward_bound(expected, dtype, x):
    """The kernel's x * scale + bias is one fused multiply-add (one rounding in the compute type)
    and the store one rounding to the dtype; the float64 reference rounds x * scale once more."""
    return ((eps(dtype) + eps_acc(dtype)) * expected.abs() + eps(torch.float64) * (x.double() * SCALE).abs()
            + floor(dtype))


def grad_reference(x, bias, dy):
    g = torch.where(x.double() * SCALE + bias.double() > 0, dy.double(), 0.0)
    return g * SCALE, g.reshape(-1, g.shape[-1]).sum(0)


def check_grads(dx, dbias, x, bias, dy, what):
    ex, ebias = grad_reference(x, bias, dy)
    # dx = g * scale: one product in the compute type, rounded once to the dtype.
    assert_within(dx, ex, (eps(dx.dtype) + eps_acc(dx.dtype)) * ex.abs() + floor(dx.dtype), f"dx {what}")
    # dbias adds `rows` values in the compute type in a fixed order: at most one rounding of the
    # running sum per addition, so rows * eps_acc * sum |g|; then one rounding to the dtype.
    g_abs = torch.where(ex != 0, dy.double(), 0.0).reshape(-1, dy.shape[-1]).abs().sum(0)
    rows = dy.numel() // max(dy.shape[-1], 1)
    bound = rows * eps_acc(dx.dtype) * g_abs + eps(dx.dtype) * ebias.abs() + floor(dx.dtype)
    assert_within(dbias, ebias, bound, f"dbias {what}")


# ---------------------------------------------------------------------------------------------
# 1. The library: registered ops, the target it was built for
# ---------------------------------------------------------------------------------------------
def test_versions_op_and_target():
    """coursekit.loader recognises a loaded course library by its `versions` op; the target is
    the oldest torch the build promises to load into, which cannot be newer than this one."""
    assert OPS.versions("fused_op") == [] and OPS.versions("fused_op_backward") == []
    with pytest.raises(RuntimeError, match="versions: unknown op 'nope'"):
        OPS.versions("nope")
    installed = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert (2, 10) <= custom_ops_stable.TARGET <= installed, (custom_ops_stable.TARGET, torch.__version__)


# ---------------------------------------------------------------------------------------------
# 2. Forward and backward against the reference, and against route 2
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_forward(dtype, device):
    for shape in SHAPES:
        x, bias = inputs(shape, dtype, device)
        out = custom_ops_stable.fused_op(x, bias, SCALE)
        assert out.dtype == dtype and out.device == x.device and out.is_contiguous()
        expected = reference(x, bias)
        assert_within(out, expected, forward_bound(expected, dtype, x), shape_id(shape))


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_backward(dtype, device):
    for shape in SHAPES:
        x, bias = inputs(shape, dtype, device)
        x.requires_grad_()
        bias.requires_grad_()
        dy = torch.randn(shape, device=device).to(dtype)
        dx, dbias = torch.autograd.grad(custom_ops_stable.fused_op(x, bias, SCALE), (x, bias), dy)
        assert dx.dtype == dtype and dbias.dtype == dtype and dbias.shape == bias.shape
        check_grads(dx, dbias, x.detach(), bias.detach(), dy, shape_id(shape))


@pytest.mark.parametrize("dtype", LOW_PRECISION + (torch.float64,), ids=dtype_id)
def test_same_bits_as_the_torch_library_route(dtype, device):
    """The same kernels as route 2 (library_ops.cpp over kernel_glue.cpp): only the binding
    differs, so the bits must not."""
    import custom_ops  # noqa: F401  (importing the chapter's package loads route 2's ops)

    x, bias = inputs((37, 129), dtype, device)
    dy = torch.randn(37, 129, device=device).to(dtype)
    out = OPS.fused_op(x, bias, SCALE)
    assert torch.equal(out, torch.ops.custom_ops.fused_op(x, bias, SCALE))
    theirs = torch.ops.custom_ops.fused_op_backward(dy, out, SCALE)
    for mine, reference_bits in zip(OPS.fused_op_backward(dy, out, SCALE), theirs):
        assert torch.equal(mine, reference_bits)


def test_empty_inputs(device):
    for shape in [(0,), (0, 7), (5, 0), (2, 0, 3)]:
        x, bias = inputs(shape, torch.float32, device)
        x.requires_grad_()
        bias.requires_grad_()
        out = custom_ops_stable.fused_op(x, bias, SCALE)
        assert out.shape == x.shape
        dx, dbias = torch.autograd.grad(out, (x, bias), torch.ones_like(out))
        assert dx.shape == x.shape
        # No rows: no gradient reaches the bias, which must be 0, not uninitialized memory.
        assert torch.equal(dbias, torch.zeros_like(bias)), shape


def test_non_contiguous_and_offset_inputs(device):
    """Transposed, strided and misaligned (offset by one element) views; a strided bias and a
    non-contiguous upstream gradient: the glue hands the kernels contiguous copies."""
    x_full, _ = inputs((33, 62), torch.float32, device)
    views = {
        "transposed x": x_full[:, :31].t(),
        "strided x": x_full[:, ::2],
        "offset x": x_full.flatten()[1:1 + 31 * 33].view(31, 33),
    }
    for what, x in views.items():
        bias = torch.randn(x.shape[-1] * 2, device=device)[::2]
        assert not x.is_contiguous() or x.storage_offset() == 1
        x = x.detach().requires_grad_()
        bias.requires_grad_()
        out = custom_ops_stable.fused_op(x, bias, SCALE)
        assert out.is_contiguous()
        expected = reference(x.detach(), bias.detach())
        assert_within(out, expected, forward_bound(expected, torch.float32, x.detach()), what)
        dy = torch.randn(x.shape, device=device).t().contiguous().t()
        dx, dbias = torch.autograd.grad(out, (x, bias), dy)
        check_grads(dx, dbias, x.detach(), bias.detach(), dy, what)


def test_gradcheck(device):
    """Finite differences against the backward, in float64. Inputs keep away from relu's kink
    (inputs()' margin, far beyond gradcheck's step of 1e-6)."""
    for shape in ((5, 7), (3, 2, 4), (6,)):
        x, bias = inputs(shape, torch.float64, device)
        x.requires_grad_()
        bias.requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: custom_ops_stable.fused_op(a, b, SCALE), (x, bias))


# ---------------------------------------------------------------------------------------------
# 3. What PyTorch's tooling sees: opcheck, torch.compile
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(device):
    x, bias = inputs((9, 40), torch.float32, device)
    xt = inputs((40, 9), torch.float32, device)[0].t()  # non-contiguous: the fake must match
    y = OPS.fused_op(x, bias, SCALE)
    return {
        "fused_op": (OPS.fused_op.default, (x.clone().requires_grad_(), bias.clone().requires_grad_(), SCALE)),
        "fused_op_no_grad": (OPS.fused_op.default, (x, bias, SCALE)),
        "fused_op_non_contiguous": (OPS.fused_op.default, (xt, torch.randn(40, device=device), SCALE)),
        "fused_op_backward": (OPS.fused_op_backward.default, (torch.randn(9, 40, device=device), y, SCALE)),
    }


@pytest.mark.parametrize("name", list(_opcheck_calls("cpu")))
def test_opcheck(name, device):
    """Schema, fake implementation, autograd registration and AOT dispatch (static and dynamic
    shapes) checked against the real kernels."""
    fn, args = _opcheck_calls(device)[name]
    torch.library.opcheck(fn, args)


def test_compile_fullgraph(device):
    """fullgraph=True: any graph break would raise. aot_eager traces the joint forward and
    backward through the Python fake and autograd registrations and runs the same kernels as
    eager (the same bits); Inductor calls the op as an extern kernel.

    One graph for three row counts: the fake is Python, so the sizes stay symbolic. A Meta
    kernel written against the stable ABI reads int64 sizes only, which pins each size it
    reads (a guard "rows == 8"), and a dynamic compile would then recompile at every new size."""
    from torch._dynamo.utils import counters

    def model(x, bias):
        return custom_ops_stable.fused_op(x * 1.5, bias, SCALE)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for shape in ((8, 40), (13, 40), (21, 40)):
        x, bias = inputs(shape, torch.float32, device)
        x.requires_grad_()
        bias.requires_grad_()
        out = compiled(x, bias)
        expected = model(x, bias)
        assert torch.equal(out, expected)
        for g, e in zip(torch.autograd.grad(out.sum(), (x, bias)), torch.autograd.grad(expected.sum(), (x, bias))):
            assert torch.equal(g, e)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
    x, bias = inputs((8, 40), torch.float32, device)
    # Inductor may fuse x * 1.5 differently from eager: compare with tolerances.
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x, bias), model(x, bias))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# 4. Misuse
# ---------------------------------------------------------------------------------------------
def misuse_cases(device):
    x = torch.randn(4, 3, device=device)
    bias = torch.randn(3, device=device)
    op = r"custom_ops_stable::fused_op: "
    return {
        "wrong bias length": ((x, torch.randn(5, device=device)),
                              op + r"bias has shape \[5\] but input has shape \[4, 3\]; bias must be 1-D"),
        "2-D bias": ((x, torch.randn(1, 3, device=device)), op + r"bias has shape \[1, 3\]"),
        "0-d input": ((torch.tensor(1.0, device=device), bias), op + "input is 0-d"),
        "integer input": ((x.long(), bias), op + r"input has dtype (Long|torch\.int64), which is not supported"),
        "mixed dtypes": ((x, bias.double()),
                         op + r"input is (Float|torch\.float32) but bias is (Double|torch\.float64)"),
    }


def test_misuse_raises_naming_the_op(device):
    """The C++ checks (stable_ops.cpp) throw std::runtime_error: a RuntimeError in Python."""
    for what, (args, message) in misuse_cases(device).items():
        with pytest.raises(RuntimeError, match=message):
            custom_ops_stable.fused_op(*args, SCALE)


def test_misuse_raises_on_meta_tensors_too():
    """Shape-only tracing must reject what the kernel rejects: meta tensors reach the fake
    registered in Python, which checks the same things."""
    for what, (args, message) in misuse_cases("meta").items():
        with pytest.raises(RuntimeError, match=message):
            custom_ops_stable.fused_op(*args, SCALE)
    with pytest.raises(RuntimeError, match=r"custom_ops_stable::fused_op: input is on cpu but bias is on meta"):
        custom_ops_stable.fused_op(torch.randn(4, 3), torch.randn(3, device="meta"), SCALE)


def test_backward_misuse(device):
    grad = torch.randn(4, 6, device=device)
    op = r"custom_ops_stable::fused_op_backward: "
    with pytest.raises(RuntimeError, match=op + r"grad has shape \[4, 6\] but output has shape \[4, 5\]"):
        OPS.fused_op_backward(grad, torch.randn(4, 5, device=device), SCALE)
    mixed = op + r"grad is (Float|torch\.float32) but output is (Double|torch\.float64)"
    with pytest.raises(RuntimeError, match=mixed):
        OPS.fused_op_backward(grad, grad.double(), SCALE)


@pytest.mark.cuda
def test_device_mismatch():
    require_cuda()
    x, bias = inputs((4, 6), torch.float32, "cuda")
    op = r"custom_ops_stable::fused_op: "
    with pytest.raises(RuntimeError, match=op + r"input is on cuda:0 but bias is on cpu"):
        custom_ops_stable.fused_op(x, bias.cpu(), SCALE)
    with pytest.raises(RuntimeError, match=op + r"input is on cpu but bias is on cuda:0"):
        custom_ops_stable.fused_op(x.cpu(), bias, SCALE)


# ---------------------------------------------------------------------------------------------
# 5. CUDA: the current stream and the device guard, through the stable API
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_graph_capture():
    """Capture runs on a side stream and fails on any launch to another one: the launches
    follow the current stream (the C shim's), and a replay on new inputs matches eager."""
    require_cuda()
    x, bias = inputs((257, 129), torch.float32, "cuda")
    dy = torch.randn(257, 129, device="cuda")
    static = [t.clone() for t in (x, bias, dy)]

    def forward_and_backward(x, bias, dy):
        out = OPS.fused_op(x, bias, SCALE)
        return (out, *OPS.fused_op_backward(dy, out, SCALE))

    forward_and_backward(*static)  # warm-up: lazy initialisation happens outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_and_backward(*static)
    fresh = [*inputs((257, 129), torch.float32, "cuda"), torch.randn_like(dy)]
    for buffer, value in zip(static, fresh):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, forward_and_backward(*fresh)):
        assert torch.equal(got, want)


@pytest.mark.cuda
def test_second_gpu():
    """The device guard: tensors on cuda:1 run on cuda:1 whatever the current device is."""
    require_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x, bias = inputs((33, 65), torch.float32, "cuda:1")
    with torch.cuda.device(0):
        out = custom_ops_stable.fused_op(x, bias, SCALE)
    assert out.device == x.device
    expected = reference(x, bias)
    assert_within(out, expected, forward_bound(expected, torch.float32, x))


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW_PRECISION + (torch.float64,), ids=dtype_id)
def test_sanitizer_small(dtype):
    """The small run the GPU pass puts under compute-sanitizer: forward and backward through
    the stable glue on small, irregular shapes."""
    require_cuda()
    for shape in ((1, 1), (3, 33), (37, 65)):
        x, bias = inputs(shape, dtype, "cuda")
        dy = torch.randn(shape, device="cuda").to(dtype)
        out = OPS.fused_op(x, bias, SCALE)
        dx, dbias = OPS.fused_op_backward(dy, out, SCALE)
        expected = reference(x, bias)
        assert_within(out, expected, forward_bound(expected, dtype, x))
        check_grads(dx, dbias, x, bias, dy, shape_id(shape))
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# 6. What the library needs from libtorch: its undefined dynamic symbols
# ---------------------------------------------------------------------------------------------
# C shim functions after 2.10, by the torch release that added them: those that torch/csrc/stable
# can reach (the per-op aoti_torch_<device>_<op> shims are left out). From pytorch's
# torch/csrc/stable/c/shim_function_versions.txt and torch/csrc/stable/c/shim.h.
SHIM_ADDED_IN = {
    (2, 11): {"torch_from_blob", "torch_dtype_float8_e8m0fnu", "torch_dtype_float4_e2m1fn_x2"},
    (2, 12): {"torch_library_def_with_tags", "aoti_torch_dtype_float8_e8m0fnu", "aoti_torch_dtype_float4_e2m1fn_x2"},
    (2, 13): {"torch_library_set_python_module", "torch_exception_get_what",
              "torch_exception_get_what_without_backtrace", "torch_new_stable_ivalue", "torch_delete_stable_ivalue",
              "torch_stream_native_handle", "torch_new_generator_handle", "torch_delete_generator",
              "torch_generator_get_device"},
}
# The C shim: extern "C" functions, unmangled, which is what makes them stable across releases.
C_SHIM = re.compile(r"(aoti_torch|torch)_\w+")
# libtorch's C++ API: a symbol whose demangled name involves its namespaces (a function, a
# vtable, a typeinfo, or a std:: template over one of their types).
LIBTORCH_CXX = re.compile(r"\b(c10|at|torch|caffe2)::")


def shim_added_in(name):
    if name.startswith("torch_tag_"):  # the tag getters, all of them 2.12
        return (2, 12)
    return next((version for version, names in SHIM_ADDED_IN.items() if name in names), None)


def undefined_symbols(path, dynamic):
    """{mangled name: demangled name} of the symbols `path` needs from elsewhere."""
    nm, cxxfilt = shutil.which("nm"), shutil.which("c++filt")
    if nm is None or cxxfilt is None:
        pytest.skip("nm and c++filt (binutils) are needed to read the library's symbols")
    listing = subprocess.run([nm, *(["-D"] if dynamic else []), "--undefined-only", str(path)],
                             capture_output=True, text=True, check=True).stdout
    # "                 U name@VERSION": the last field, without its symbol version.
    names = [line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()]
    demangled = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    return dict(zip(names, demangled))


def libtorch_cxx(symbols):
    return {demangled for demangled in symbols.values() if LIBTORCH_CXX.search(demangled)}


def c_shim(symbols):
    return {name for name in symbols if C_SHIM.fullmatch(name)}


def library_path():
    if "so_path" in custom_ops_stable.EXTENSION:
        return Path(custom_ops_stable.EXTENSION["so_path"])
    # Preloaded by load_jit.py or by hand: torch.ops.load_library remembers the path.
    for path in map(Path, torch.ops.loaded_libraries):
        if path.name.startswith("custom_ops_stable_jit.") or path.parent.name == "custom_ops_stable":
            return path
    pytest.fail("custom_ops_stable's library is loaded but its file was not found")


def build_object(name):
    """An object file of the JIT build (load_jit.py keeps them next to the library)."""
    path = library_path().parent / name
    if not path.exists():
        pytest.skip(f"{name} exists only in a JIT build folder (this library came by the "
                    f"{custom_ops_stable.EXTENSION['route']!r} route; COURSE_EXT_ROUTE=jit builds one)")
    return path


def test_glue_links_only_the_c_shim():
    """stable_ops.cpp, the stable glue, reaches libtorch through C functions only: no c10::,
    at:: or torch:: C++ symbol, whose mangled names and class layouts change between releases."""
    symbols = undefined_symbols(build_object("stable_ops.o"), dynamic=False)
    assert {"torch_library_impl", "aoti_torch_library_init_def"} <= c_shim(symbols), sorted(c_shim(symbols))
    assert not libtorch_cxx(symbols), sorted(libtorch_cxx(symbols))


def test_library_links_no_libtorch_cxx_symbols():
    """The whole library, the kernels and the CPU twin (../custom_kernels_cpu.cpp) included,
    needs only C shim functions from libtorch. The twin uses header-only types and serial
    loops for this: AT_DISPATCH's error path and at::parallel_for would each pull in c10:: and
    at:: symbols and tie the binary to one torch release."""
    needed = libtorch_cxx(undefined_symbols(library_path(), dynamic=True))
    assert not needed, f"libtorch C++ symbols needed by the library: {sorted(needed)}"


def test_library_needs_no_shim_function_newer_than_its_target():
    """What TORCH_TARGET_VERSION buys: built against a newer torch, the library still asks
    nothing of libtorch that its target release lacks, so it loads into that release."""
    shim = c_shim(undefined_symbols(library_path(), dynamic=True))
    assert "torch_library_impl" in shim  # the 2.10 registration path, every target has it
    too_new = {name: shim_added_in(name) for name in shim
               if shim_added_in(name) is not None and shim_added_in(name) > custom_ops_stable.TARGET}
    assert not too_new, f"built for torch >= {custom_ops_stable.TARGET}, but needs {too_new}"
