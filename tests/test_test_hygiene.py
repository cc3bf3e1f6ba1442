"""Rules for the suite itself: every test asserts something (a test that only runs code passes whatever the code
returns), and the C++ CPU extension's tests fail rather than skip where a compiler is present (tests/cpu_ext_gate.py).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import cpu_ext_gate

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# A call of one of these counts as an assertion: pytest's own, or a helper named for checking.
ASSERTING_CALLS = {"pytest.raises", "pytest.warns", "pytest.fail", "pytest.deprecated_call", "raises", "warns"}
HELPER_PREFIXES = ("assert", "check", "expect", "verify", "_assert", "_check", "_expect", "_verify")
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _called_names(fn: Function) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else "")
    return names


def _asserts_directly(fn: Function) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ASSERTING_CALLS or name.rsplit(".", 1)[-1].startswith(HELPER_PREFIXES):
                return True
    return False


def find_tests_without_an_assertion(sources: dict[str, str]) -> list[str]:
    """Test functions (test*) of the given {name: source} that neither assert, nor use pytest.raises/warns/fail, nor
    call a helper named assert_/check_/expect_/verify_, nor call (by name, transitively) any function of the
    sources that does."""
    trees = {name: ast.parse(source, filename=name) for name, source in sources.items()}
    functions: dict[str, list[Function]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, Function):
                functions.setdefault(node.name, []).append(node)
    asserting = {name for name, defs in functions.items() if any(_asserts_directly(d) for d in defs)}
    grew = True
    while grew:  # a helper that calls an asserting helper asserts too
        grew = False
        for name, defs in functions.items():
            if name not in asserting and any(_called_names(d) & asserting for d in defs):
                asserting.add(name)
                grew = True
    offenders = []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, Function) and node.name.startswith("test"):
                if not (_asserts_directly(node) or _called_names(node) & asserting):
                    offenders.append(f"{file}:{node.lineno} {node.name}")
    return offenders


@pytest.mark.parametrize("source, offenders", [
    ("def test_a():\n    f()\n", ["t.py:1 test_a"]),
    ("def test_a():\n    assert f()\n", []),
    ("import pytest\ndef test_a():\n    with pytest.raises(ValueError):\n        f()\n", []),
    ("def test_a():\n    assert_close(f(), 1)\n", []),
    ("def _run():\n    assert f()\ndef helper():\n    _run()\ndef test_a():\n    helper()\n", []),
    ("def _run():\n    f()\ndef test_a():\n    _run()\n", ["t.py:3 test_a"]),
    ("class TestX:\n    def test_a(self):\n        self.f()\n", ["t.py:2 test_a"]),
])
def test_the_check_finds_find_tests_without_an_assertion(source: str, offenders: list[str]) -> None:
    assert find_tests_without_an_assertion({"t.py": source}) == offenders


def test_every_test_asserts_something() -> None:
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(TESTS.rglob("*.py"))}
    assert len(sources) > 20, sources.keys()
    offenders = find_tests_without_an_assertion(sources)
    assert not offenders, "tests without an assertion (assert what the code must do):\n" + "\n".join(offenders)


class _Boom:
    def load(self) -> None:
        raise RuntimeError("g++: error: broken.cpp")


def test_the_cpu_ext_gate_skips_where_there_is_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ext_gate.cpu_ext, "unavailable_reason", lambda: "no C++ compiler ('c++' not on PATH)")
    with pytest.raises(pytest.skip.Exception, match="no C\\+\\+ compiler"):
        cpu_ext_gate.require_cpu_ext()
    assert not cpu_ext_gate.cpu_ext_expected()


def test_the_cpu_ext_gate_fails_a_broken_build_where_a_compiler_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ext_gate.cpu_ext, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cpu_ext_gate.cpu_ext, "load", _Boom().load)
    with pytest.raises(pytest.fail.Exception, match="broken.cpp"):
        cpu_ext_gate.require_cpu_ext()
    assert cpu_ext_gate.cpu_ext_expected()
