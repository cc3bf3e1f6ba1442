"""benchmarks/ holds maintained tools: each script has a header that says what it measures and how to run it, answers
`--help`, and runs as `python -m benchmarks.X` from the checkout root without editing sys.path (an edited sys.path
puts the checkout root first wherever the script runs, which is how a root folder once hid a PyPI package)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


# Parsed once, here on the main thread: CPython 3.11's parser is not safe to run from several threads at once
# (SystemError "AST constructor recursion depth mismatch" when the --help pool below parsed in its workers).
TREES = {path: _parse(path) for path in SCRIPTS}


def _tree(path: Path) -> ast.Module:
    return TREES[path] if path in TREES else _parse(path)


def _has_main(tree: ast.Module) -> bool:
    """A script: `if __name__ == "__main__":` at module level. The others are helpers the scripts import."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


MAIN_SCRIPTS = [p for p in SCRIPTS if _has_main(_tree(p))]


def _imports_vllm_at_top(tree: ast.Module) -> bool:
    """Scripts that run in vLLM's own venv (they import vllm when loaded), not in Conveyor's."""
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            return True
    return False


def sys_path_edits(source: str) -> list[str]:
    """Every place the code changes sys.path: a call of one of its methods, an assignment to it, or site.addsitedir."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner == "sys.path" or (owner == "site" and node.func.attr == "addsitedir"):
                target = node
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):  # also `sys.path += ...`
            if ast.unparse(node) == "sys.path":
                target = node
        if target is not None:
            found.append(f"line {target.lineno}: {ast.unparse(target)}")
    return found


@pytest.mark.parametrize("source, expected", [
    ("import sys\nsys.path.insert(0, 'x')\n", 1),
    ("import sys\nsys.path.append('x')\n", 1),
    ("import sys\nsys.path = ['x']\n", 1),
    ("import sys\nsys.path += ['x']\n", 1),
    ("import site\nsite.addsitedir('x')\n", 1),
    ("import sys\nprint(sys.path[0])\nexcept_ok = 'sys.path.insert'\n", 0),  # reading it, or the words in a string
])
def test_the_sys_path_check_finds_edits(source: str, expected: int) -> None:
    assert len(sys_path_edits(source)) == expected


def test_there_are_scripts_to_check() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_script_edits_sys_path(path: Path) -> None:
    edits = sys_path_edits(path.read_text())
    assert not edits, f"{path.name} edits sys.path (run it as python -m benchmarks.{path.stem} instead): {edits}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_script_has_a_header(path: Path) -> None:
    tree = _tree(path)
    doc = ast.get_docstring(tree) or ""
    assert len(doc.split()) >= 8, f"{path.name}: no module docstring saying what it measures or provides"
    if _has_main(tree):  # a script also says how to run it
        assert f"-m benchmarks.{path.stem}" in doc or f"benchmarks/{path.stem}.py" in doc, (
            f"{path.name}: its docstring shows no command line (python -m benchmarks.{path.stem} ...)")


# Runs each named script as `python -m benchmarks.NAME --help` would (runpy as __main__, the checkout root first on
# sys.path), all in one interpreter: most scripts import torch, ~2.5 s a process on two cores, so one process per
# script made this module ~25 s of the suite. Prints the results as one JSON line after a marker.
HELP_MARKER = "@@help-results@@"
HELP_RUNNER = f"""
import contextlib, io, json, runpy, sys
names, results = sys.argv[1:], {{}}
for name in names:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [name, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("benchmarks." + name, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # an import error: what a failed `python -m` would show
            code = 1
            err.write(repr(exc))
    results[name] = {{"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}}
sys.__stdout__.write("\\n{HELP_MARKER}" + json.dumps(results) + "\\n")
"""


def _run_helps(python: str, paths: list[Path]) -> dict[str, dict]:
    """Every script's --help in one `python` process: {script file name: returncode, stdout, stderr}."""
    if not paths:
        return {}
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([python, "-c", HELP_RUNNER, *(p.stem for p in paths)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    _, marker, payload = proc.stdout.rpartition(HELP_MARKER)
    if not marker:  # the interpreter itself died: every script of the group fails with its output
        failed = {"returncode": proc.returncode or 1, "stdout": proc.stdout, "stderr": proc.stderr}
        return {p.name: failed for p in paths}
    return {f"{name}.py": result for name, result in json.loads(payload.splitlines()[0]).items()}


@pytest.fixture(scope="module")
def help_results() -> dict[str, dict | None]:
    """Every script's --help: those of Conveyor's venv in two processes (one a core), vLLM's in its venv. Helpers
    (no __main__) are left out: the scripts that use them import them on the way to --help."""
    ours = [p for p in MAIN_SCRIPTS if not _imports_vllm_at_top(_tree(p))]
    theirs = [p for p in MAIN_SCRIPTS if _imports_vllm_at_top(_tree(p))]
    jobs = [(sys.executable, ours[0::2]), (sys.executable, ours[1::2])]
    if VLLM_PYTHON.exists():
        jobs.append((str(VLLM_PYTHON), theirs))
    results: dict[str, dict | None] = {p.name: None for p in theirs}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for group in pool.map(lambda job: _run_helps(*job), jobs):
            results.update(group)
    return results


@pytest.mark.slow  # ~10 s of subprocesses importing torch: out of `make test-fast`
@pytest.mark.parametrize("path", MAIN_SCRIPTS, ids=lambda p: p.name)
def test_every_script_answers_help(path: Path, help_results: dict) -> None:
    result = help_results[path.name]
    if result is None:
        pytest.skip(f"{path.name} runs in vLLM's venv, and {VLLM_PYTHON} is missing (bash benchmarks/setup_vllm.sh)")
    assert result["returncode"] == 0, f"{path.name}: exit {result['returncode']}\n{result['stderr'][-3000:]}"
    assert "usage:" in result["stdout"], f"{path.name} --help printed no usage:\n{result['stdout'][-2000:]}"
