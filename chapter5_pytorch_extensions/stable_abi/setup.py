"""pip install . (in stable_abi/) builds custom_ops_stable, the stable-ABI build of the fused op.

    python -m pip install --no-build-isolation .      install into this environment
    python -m pip wheel --no-build-isolation .        a wheel: custom_ops_stable-...-cp310-abi3-<platform>.whl

CUDAExtension when CUDA is usable, else a CPU-only CppExtension with the reason printed; the
switches are the chapter's (USE_CUDA=0/1, DEBUG=1, TORCH_CUDA_ARCH_LIST), through the same
helpers (common/coursekit/build.py).

What differs from the chapter's setup.py is what the library promises:
- py_limited_api=True: the library is compiled against CPython's limited API
  (-DPy_LIMITED_API, added by torch's BuildExtension), is named _C.abi3.so and does not link
  libtorch_python. It includes no Python header at all: it only registers ops, loaded with
  torch.ops.load_library. So one wheel serves every CPython from 3.10 on (the cp310-abi3 tag).
- the stable ABI (stable_ops.cpp): its glue calls libtorch only through extern "C" functions,
  so the wheel is meant to load into every torch from its target (custom_ops_stable.TARGET) on,
  not just the one it was built against. stable_ops.cpp sets the target and says why there.
"""
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAPTER = HERE.parent
sys.path[:0] = [str(HERE), str(CHAPTER.parent / "common")]
from coursekit import build  # noqa: E402

from load_jit import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

PACKAGE = "custom_ops_stable"
# The oldest CPython the wheel serves: torch's BuildExtension compiles py_limited_api extensions
# with -DPy_LIMITED_API=0x030A0000 (3.10), and the wheel's tag must not promise less.
LIMITED_API = "cp310"


def extension():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    with_cuda, reason = build.cuda_decision(PACKAGE)
    if with_cuda:
        reason += f"; TORCH_CUDA_ARCH_LIST={build.pin_cuda_arch()}"
    print(f"[{PACKAGE}] building the {'CUDA + CPU' if with_cuda else 'CPU-only'} stable-ABI extension: {reason}",
          file=sys.stderr)
    cls = CUDAExtension if with_cuda else CppExtension
    # Absolute paths: two of the sources live one folder up, in the chapter, and a relative
    # "../" path would put their objects outside setuptools' build folder.
    sources = CPP_SOURCES + (CUDA_SOURCES if with_cuda else [])
    return cls(f"{PACKAGE}._C", sources=sources, include_dirs=build.include_dirs(CHAPTER),
               extra_compile_args=build.compile_flags(with_cuda), py_limited_api=True)


build.import_torch(PACKAGE)
from setuptools import setup  # noqa: E402

# Unlike the chapter's classic wheel (pinned to the torch it was built with), this one asks only
# for a torch at least as new as its target: the oldest release whose C shim it calls. One home
# for that number: stable_ops.cpp.
TARGET_MINOR = re.search(r"#define STABLE_ABI_TARGET_MINOR (\d+)", (HERE / "stable_ops.cpp").read_text()).group(1)
from torch.utils.cpp_extension import BuildExtension  # noqa: E402

setup(
    name=PACKAGE,
    version="0.1.0",
    description="Chapter 5 of the CUDA course: the fused op built against the LibTorch stable ABI",
    packages=[PACKAGE],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension, "build_py": build.build_py_with_loader(PACKAGE)},
    options={"bdist_wheel": {"py_limited_api": LIMITED_API}},
    install_requires=[f"torch>=2.{TARGET_MINOR}"],
    python_requires=">=3.10",
)
