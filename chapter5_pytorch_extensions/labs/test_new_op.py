"""Tests of new_op.py, the project generator: names, overwriting, the generated tree, and the
whole promise end to end (a generated project, outside this repository, pip-installs and passes
its own tests)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import new_op

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # labs/ -> the chapter -> the repository
# Unusual on purpose: the end-to-end test installs it into this interpreter and removes it.
E2E_NAME = "course_tmpl_op"


def expected_files(name):
    return {".gitignore", "README.md", "setup.py", "pyproject.toml", "load_jit.py", f"{name}/__init__.py",
            f"csrc/{name}.h", f"csrc/{name}_kernel.cu", f"csrc/{name}_cpu.cpp", f"csrc/{name}.cpp",
            f"tests/test_{name}.py", "tests/conftest.py"}


def tree(folder):
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name, problem", [
    ("MyOp", "lowercase"),
    ("my-op", "lowercase"),
    ("2d_op", "starting with a letter"),
    ("_op", "starting with a letter"),
    ("", "lowercase"),
    ("my op", "lowercase"),
    ("import", "Python keyword"),
    ("new", r"C\+\+ keyword"),
    ("json", "taken"),
    ("torch", "taken"),
    ("aten", "taken"),
    ("tests", "taken"),
])
def test_bad_names_are_refused(tmp_path, name, problem):
    with pytest.raises(ValueError, match=problem):
        new_op.generate(name, tmp_path)
    assert not any(tmp_path.iterdir()), "nothing is written for a refused name"


def test_good_names_pass_and_camel_case():
    for name in ("my_op", "scaled_tanh", "op2d", "x"):
        new_op.check_name(name)
    assert new_op.placeholders("scaled_tanh_v2") == {
        "{{name}}": "scaled_tanh_v2", "{{Name}}": "ScaledTanhV2", "{{NAME}}": "SCALED_TANH_V2"}


def test_cli_reports_errors_and_next_steps(tmp_path):
    bad = subprocess.run([sys.executable, str(HERE / "new_op.py"), "My-Op", "--dest", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "op name 'My-Op'" in bad.stderr
    good = subprocess.run([sys.executable, str(HERE / "new_op.py"), "my_op", "--dest", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    assert "csrc/my_op_kernel.cu" in good.stdout
    assert f"cd {tmp_path / 'my_op'}" in good.stdout and "pip install --no-build-isolation ." in good.stdout
    assert tree(tmp_path / "my_op") == expected_files("my_op")


def test_existing_project_is_not_overwritten(tmp_path):
    project = new_op.generate("my_op", tmp_path)
    kernel = project / "csrc" / "my_op_kernel.cu"
    kernel.write_text("// my own kernel\n")
    (project / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="not empty"):
        new_op.generate("my_op", tmp_path)
    assert kernel.read_text() == "// my own kernel\n"

    assert new_op.generate("my_op", tmp_path, force=True) == project
    assert kernel.read_text() != "// my own kernel\n"
    assert (project / "notes.txt").read_text() == "mine\n", "--force rewrites only the template's files"


def test_empty_existing_folder_is_used(tmp_path):
    (tmp_path / "my_op").mkdir()
    assert tree(new_op.generate("my_op", tmp_path)) == expected_files("my_op")


def test_generated_tree_is_standalone_and_fully_rendered(tmp_path):
    name = "scaled_op"
    project = new_op.generate(name, tmp_path)
    assert tree(project) == expected_files(name)
    for path in project.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        where = path.relative_to(project)
        assert "{{" not in text and "}}" not in text, f"{where}: a placeholder was left"
        assert "{{" not in str(where)
        # Nothing of the course: no shared headers or Python helpers, no paths into the repo.
        for needle in ("coursekit", "common/", "course/", "course::", "chapter"):
            assert needle not in text, f"{where} mentions {needle!r}"
        if path.suffix == ".py":
            compile(text, str(path), "exec")
    # The C++ class and the macro placeholders were rendered too.
    assert "class ScaledOpFunction" in (project / "csrc" / f"{name}.cpp").read_text()
    assert "#define SCALED_OP_HD" in (project / "csrc" / f"{name}.h").read_text()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH")
def test_generated_kernel_compiles_without_torch(tmp_path):
    # A bare nvcc, no torch include path, with the half/bfloat16 switches torch's builds add.
    project = new_op.generate("my_op", tmp_path)
    subprocess.run(["nvcc", "-c", "-std=c++17", "-gencode=arch=compute_75,code=sm_75",
                    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-I", "csrc", "csrc/my_op_kernel.cu",
                    "-o", str(tmp_path / "kernel.o")], cwd=project, check=True)


def cuda_build_possible():
    """Whether the generated setup.py will build the CUDA kernels here."""
    from torch.utils.cpp_extension import CUDA_HOME  # None unless torch is a CUDA build
    return os.environ.get("USE_CUDA") != "0" and CUDA_HOME is not None


def cuda_build_possible_without_gpu():
    import torch
    return cuda_build_possible() and not torch.cuda.is_available()


def cuda_build_expected():
    """Whether the CUDA kernels will be built here and a GPU can run them."""
    import torch
    return cuda_build_possible() and torch.cuda.is_available()


def test_generated_project_installs_and_passes_its_tests(tmp_path):
    # What a learner does, in a folder outside the repository, so that nothing of the course
    # (its conftest.py files, its common/ folder) can help the project along.
    assert REPO not in tmp_path.resolve().parents, f"{tmp_path} must lie outside {REPO}"
    project = new_op.generate(E2E_NAME, tmp_path)
    env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))}
    if cuda_build_possible_without_gpu() and not env.get("TORCH_CUDA_ARCH_LIST"):
        # The generated setup.py asks for an arch list where no GPU is visible to pick one
        # from; these are the GPUs the course supports (the top-level README).
        env["TORCH_CUDA_ARCH_LIST"] = "7.5;8.0;9.0"
    pip = [sys.executable, "-m", "pip"]

    def run(cmd):
        result = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-6000:]}"
        return output

    run(pip + ["install", "--no-build-isolation", "--no-deps", "--disable-pip-version-check", "."])
    try:
        # The commands of the generated README, in the project folder, which Python puts first on
        # sys.path: the checkout's package is imported, and must load the installed library (not
        # JIT-build the checkout), and pytest's header must say so.
        route = run([sys.executable, "-c", f"import {E2E_NAME}; print({E2E_NAME}.EXTENSION['route'])"]).strip()
        assert route.splitlines()[-1] == "installed", f"loaded by the {route!r} route, not the installed library"
        output = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"])  # no -q: it hides the header
        header = re.search(rf"^{E2E_NAME} extension: route=(\w+) (\S+)", output, re.M)
        assert header, f"no route line in pytest's header:\n{output[:3000]}"
        assert header.group(1) == "installed" and project not in Path(header.group(2)).parents, header.group(0)
        summary = output.strip().splitlines()[-1]
        assert re.search(r"\b\d+ passed\b", summary) and "failed" not in summary and "error" not in summary, summary
        if cuda_build_expected():
            # On a GPU machine the generated tests' cuda half must have run, not skipped.
            assert "skipped" not in summary, f"the CUDA tests were skipped on a GPU machine:\n{output[-6000:]}"
    finally:
        subprocess.run(pip + ["uninstall", "-y", "--disable-pip-version-check", E2E_NAME], env=env,
                       capture_output=True)
