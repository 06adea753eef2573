"""Start a new PyTorch C++/CUDA extension project from the course's template.

    python labs/new_op.py my_op --dest ~/src          writes ~/src/my_op/
    python labs/new_op.py my_op --dest ~/src --force  writes over the template's files there

The project stands alone (it needs torch and, for its CUDA kernels, the CUDA toolkit; nothing
from this course) and builds and passes its tests as generated, on CPU and on GPU. Its example
op, `my_op(x, alpha) = alpha * tanh(x)`, is there to be replaced: the generated README says how.

The template is op_template/: every file ends in `.tmpl` (so no tool here mistakes it for code
to build, test or lint) and is rendered by plain text substitution, its path too:

    {{name}}   the op name, as given: my_op
    {{Name}}   CamelCase, for C++ class names: MyOp
    {{NAME}}   upper case, for C macros: MY_OP
"""
import argparse
import keyword
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "op_template"
SUFFIX = ".tmpl"

# The name becomes a Python package, a C++ namespace, a torch.ops namespace and file names, so
# it must be all of those at once, and shadow nothing a project imports.
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
_CXX_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
    char32_t class compl concept const consteval constexpr constinit const_cast continue co_await
    co_return co_yield decltype default delete do double dynamic_cast else enum explicit export
    extern false float for friend goto if inline int long mutable namespace new noexcept not
    not_eq nullptr operator or or_eq private protected public register reinterpret_cast requires
    return short signed sizeof static static_assert static_cast struct switch template this
    thread_local throw true try typedef typeid typename union unsigned using virtual void volatile
    wchar_t while xor xor_eq
""".split())
# torch.ops namespaces and C++ namespaces that torch itself uses, and the package's own names.
_TAKEN = frozenset({"torch", "aten", "prim", "prims", "c10", "at", "std", "cuda", "quantized",
                    "triton", "tests", "csrc", "build", "setup"})


def check_name(name):
    """Raise ValueError saying what is wrong unless `name` can name a new op project."""
    if not _NAME_RE.match(name):
        raise ValueError(f"op name {name!r}: use lowercase letters, digits and underscores, starting "
                         "with a letter (it names a Python package, a C++ namespace and torch.ops."
                         "<name>), e.g. scaled_tanh")
    if keyword.iskeyword(name):
        raise ValueError(f"op name {name!r} is a Python keyword")
    if name in _CXX_KEYWORDS:
        raise ValueError(f"op name {name!r} is a C++ keyword")
    if name in sys.stdlib_module_names or name in _TAKEN:
        raise ValueError(f"op name {name!r} is taken (by Python's standard library, torch, or the "
                         "project's own layout); importing it would be ambiguous")


def placeholders(name):
    return {
        "{{name}}": name,
        "{{Name}}": "".join(part.capitalize() for part in name.split("_")),
        "{{NAME}}": name.upper(),
    }


def render(text, name):
    for key, value in placeholders(name).items():
        text = text.replace(key, value)
    return text


def template_files():
    """(template path, project-relative path with placeholders) for every template file."""
    return [(path, path.relative_to(TEMPLATE).as_posix()[: -len(SUFFIX)])
            for path in sorted(TEMPLATE.rglob("*" + SUFFIX)) if path.is_file()]


def generate(name, dest, force=False):
    """Write the project for op `name` into dest/name/ and return that folder.

    Raises ValueError for a bad name and FileExistsError where dest/name is a non-empty folder
    (or a file), unless force: then the template's files are written over, and other files
    there (a build/ folder, your notes) are left alone.
    """
    check_name(name)
    project = Path(dest).expanduser().resolve() / name
    if project.exists() and not project.is_dir():
        raise FileExistsError(f"{project} exists and is not a folder")
    if project.is_dir() and any(project.iterdir()) and not force:
        raise FileExistsError(f"{project} exists and is not empty; pick another --dest, or --force to "
                              "write the template's files over the ones there")
    files = template_files()
    if not files:
        raise FileNotFoundError(f"no template files (*{SUFFIX}) under {TEMPLATE}")
    for source, relative in files:
        target = project / render(relative, name)
        text = render(source.read_text(encoding="utf-8"), name)
        leftover = re.search(r"\{\{\w+\}\}", text)
        if leftover:
            raise ValueError(f"{source}: unknown placeholder {leftover.group()}; known: "
                             + ", ".join(placeholders(name)))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return project


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the op's name: lowercase letters, digits and underscores, e.g. scaled_tanh")
    parser.add_argument("--dest", default=".", help="folder to create the project folder in (default: .)")
    parser.add_argument("--force", action="store_true",
                        help="write over the template's files in an existing, non-empty project folder")
    args = parser.parse_args(argv)
    try:
        project = generate(args.name, args.dest, force=args.force)
    except (ValueError, FileExistsError) as err:
        parser.error(str(err))
    print(f"wrote {project}/")
    for _, relative in template_files():
        print(f"  {render(relative, args.name)}")
    print(f"\nnext:\n  cd {project}\n  python -m pip install --no-build-isolation .\n  python -m pytest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
