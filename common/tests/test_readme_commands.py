"""The commands the READMEs print, checked where the CPU can check them cheaply, without running
them: every script or file a command names exists, every `--flag` given to `python X.py` is one
X.py's argparse defines, and every README spells pip and pytest the same way
(`python -m pip`, `python -m pytest`: they name the interpreter, so they use the environment of
the `python` first on PATH).

Only fenced bash blocks are read (and inline code that starts with `pip` or `pytest`, for the
spelling). A block starts in its README's folder; a path may also resolve against the README's
parent folder or a folder an earlier block of the same README went to with `cd`, because the
READMEs say in prose where their commands run (chapter 5's debugging/README.md from the chapter
folder, the top README's JIT lines in a chapter).
"""
import ast
import functools
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = sorted([ROOT / "README.md", *ROOT.glob("chapter*/README.md"), *ROOT.glob("chapter*/*/README.md")])
# The learner's own scripts, named in examples of how to run something on them.
PLACEHOLDER_SCRIPTS = {"my_script.py", "repro.py"}
# Commands that run another command given later on their line (the tool's own options before it).
LAUNCHERS = {"compute-sanitizer", "ncu", "cuda-gdb", "nsys"}
BARE = {"pip", "pip3", "pytest", "py.test", "jupyter"}


def shell_blocks(text):
    """(line number, source) of every fenced bash block."""
    for m in re.finditer(r"^```(bash|sh|shell)\n(.*?)^```", text, re.M | re.S):
        yield text[:m.start()].count("\n") + 2, m.group(2)


def commands(block):
    """Each simple command of a block as a token list: continuation lines joined, comments
    dropped, split at &&, ||, ; and |."""
    source = block.replace("\\\n", " ")
    for line in source.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current = []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&", "|&"):
                if current:
                    yield current
                current = []
            elif token.startswith("2>") or token == ">":
                continue
            else:
                current.append(token)
        if current:
            yield current


def strip_env(cmd):
    """The command without its leading VAR=value assignments."""
    while cmd and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
        cmd = cmd[1:]
    return cmd


def python_part(cmd):
    """The `python ...` a command runs, itself or under a launcher (compute-sanitizer, ncu,
    cuda-gdb ... --args), or None."""
    if cmd and cmd[0] in ("python", "python3"):
        return cmd
    if cmd and cmd[0] in LAUNCHERS:
        for i, token in enumerate(cmd):
            if token in ("python", "python3"):
                return cmd[i:]
    return None


def _options(tree):
    """(option strings of every add_argument, names of every add_parser) under an AST node."""
    flags, subcommands = set(), set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if node.func.attr == "add_argument":
            flags.update(s for s in strings if s.startswith("-"))
        elif node.func.attr == "add_parser" and strings:
            subcommands.add(strings[0])
    return flags, subcommands


@functools.lru_cache(maxsize=None)
def _coursekit_parsers():
    """{(module, function): its options} for the coursekit functions that build a command line
    for a script (bench.arguments, jit.main, ncu.workload_or_profile, ...)."""
    found = {}
    for path in (ROOT / "common" / "coursekit").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                flags, subcommands = _options(node)
                if flags or subcommands:
                    found[(path.stem, node.name)] = (flags, subcommands)
    # bench.start parses bench.arguments' command line.
    if ("bench", "arguments") in found:
        found[("bench", "start")] = found[("bench", "arguments")]
    return found


def argparse_flags(script):
    """Every option string a script's argparse defines (add_argument, in any parser or
    subparser of it), and its subcommands (add_parser), read from its source without running
    it; where it calls a coursekit function that builds its command line (jit.main,
    bench.start, ...), that function's options too."""
    tree = ast.parse(script.read_text())
    flags, subcommands = _options(tree)
    shared = _coursekit_parsers()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in shared:
            more_flags, more_subcommands = shared[(node.value.id, node.attr)]
            flags |= more_flags
            subcommands |= more_subcommands
    return flags | {"-h", "--help"}, subcommands


def resolve(name, bases):
    for base in bases:
        if base is not None and (base / Path(name).expanduser()).exists():
            return base / name
    return None


def check_readme(readme, text=None):
    """Problems with the commands of one README: a list of human-readable lines."""
    text = readme.read_text() if text is None else text
    problems, visited = [], []
    name = readme.relative_to(ROOT) if ROOT in readme.parents else readme.name
    for lineno, block in shell_blocks(text):
        cwd = readme.parent
        for cmd in commands(block):
            where = f"{name}:{lineno}"
            for i, token in enumerate(cmd):
                if token in BARE and (i == 0 or cmd[i - 1] != "-m"):
                    problems.append(f"{where}: bare `{token}` in `{' '.join(cmd)}`; write `python -m {token}`")
            cmd = strip_env(cmd)
            if not cmd:
                continue
            bases = [cwd, readme.parent, readme.parent.parent, *visited]
            if cmd[0] == "cd" and len(cmd) > 1:
                if cmd[1].startswith("~"):
                    # A folder outside the repository (~/work/my_op, which new_op.py makes):
                    # nothing there to check until the next cd.
                    cwd = None
                    continue
                cwd = resolve(cmd[1], bases)
                if cwd is None:
                    problems.append(f"{where}: `cd {cmd[1]}`: no such folder")
                else:
                    cwd = cwd.resolve()
                    visited.append(cwd)
                continue
            if cwd is None:  # after a cd out of the repository
                continue
            if cmd[0] == "source" or cmd[0].startswith("./"):
                path = cmd[1] if cmd[0] == "source" else cmd[0]
                if resolve(path, bases) is None:
                    problems.append(f"{where}: `{path}` does not exist")
                continue
            python = python_part(cmd)
            if python is None or len(python) < 2:
                continue
            if python[1:3] == ["-m", "pip"]:
                # pip reads a bare folder name as the name of a package on an index: a local
                # project is `.` or a path with a slash (./stable_abi).
                for j, arg in enumerate(python[3:], 3):
                    takes_value = python[j - 1] in ("-w", "--wheel-dir", "-r", "-c", "-f", "--find-links", "-t")
                    if not arg.startswith("-") and not takes_value and "/" not in arg and arg != "." \
                            and resolve(arg, bases) is not None:
                        problems.append(f"{where}: pip reads `{arg}` as a package name; write ./{arg}")
                continue
            if python[1:3] == ["-m", "pytest"]:
                args = python[3:]
                for j, arg in enumerate(args):
                    after_option = j > 0 and args[j - 1] in ("-k", "-m", "-p", "--tool")
                    if not arg.startswith("-") and not after_option and resolve(arg, bases) is None:
                        problems.append(f"{where}: pytest path `{arg}` does not exist")
                continue
            if python[1].startswith("-"):  # python -m <module>, python -c "...": nothing to check
                continue
            script = python[1]
            if script in PLACEHOLDER_SCRIPTS:
                continue
            path = resolve(script, bases)
            if path is None:
                problems.append(f"{where}: `{script}` does not exist")
                continue
            flags, subcommands = argparse_flags(path)
            for arg in python[2:]:
                if arg.startswith("[") or "..." in arg or "<" in arg:
                    break  # notation for optional or elided arguments
                option = arg.split("=", 1)[0]
                if option.startswith("-") and option not in flags:
                    problems.append(f"{where}: `{script}` has no option {option} (its argparse: "
                                    f"{', '.join(sorted(flags - {'-h', '--help'})) or 'none'})")
                elif not option.startswith("-") and subcommands and option not in subcommands \
                        and arg == python[2]:
                    problems.append(f"{where}: `{script}` has no subcommand {option} "
                                    f"(it has {', '.join(sorted(subcommands))})")
    # Inline code that is a pip or pytest command, outside headings (which name symptoms).
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        for span in re.findall(r"`([^`]+)`", line):
            first = strip_env(span.split())[:1]
            if first and first[0] in BARE and len(span.split()) > 1:
                problems.append(f"{name}:{lineno}: inline `{span}`; write `python -m {first[0]} ...`")
    return problems


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_commands(readme):
    problems = check_readme(readme)
    assert not problems, "\n".join(problems)


def test_generated_project_readme_commands(tmp_path):
    """chapter 5's labs/new_op.py writes a README of its own: its commands, in the project it made."""
    sys.path.insert(0, str(ROOT / "chapter5_pytorch_extensions" / "labs"))
    try:
        import new_op
    finally:
        sys.path.pop(0)
    project = new_op.generate("my_op", tmp_path)
    problems = check_readme(project / "README.md")
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_should(tmp_path):
    """The checker itself, on a README with one mistake of each kind."""
    (tmp_path / "tool.py").write_text("import argparse\np = argparse.ArgumentParser()\n"
                                      "p.add_argument('--quick', action='store_true')\np.parse_args()\n")
    readme = tmp_path / "README.md"
    (tmp_path / "sub").mkdir()
    text = ("```bash\npython tool.py --quick          # fine\npython tool.py --slow\n"
            "python missing.py\npip install .\nCOURSE_EXT_ROUTE=jit pytest -q\n"
            "python -m pytest no_such_dir\npython -m pip wheel -w build ./sub   # fine\n"
            "python -m pip wheel -w build sub\n```\nThen run `pytest -k x`.\n")
    problems = check_readme(readme, text)
    for needle in ("no option --slow", "missing.py` does not exist", "bare `pip`", "bare `pytest`",
                   "no_such_dir` does not exist", "inline `pytest -k x`", "pip reads `sub` as a package name"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    assert len(problems) == 7, "\n".join(problems)
