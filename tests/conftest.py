"""Session-wide fixtures: the tiny models, and one Ray cluster with one Serve proxy for every package that deploys
(tests/drills, tests/metrics, tests/router), started by the first test that asks for it."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default

from tests.tiny_model import build_tiny_llama  # noqa: E402

# Tests that start Ray (through `serve_cluster` or test_routing's `serve_instance`, or `conveyor serve` itself) get
# the `ray` marker here; `make test-fast` (`-m "not ray and not slow"`) leaves them and the real-model tests out.
RAY_FIXTURES = frozenset({"serve_cluster", "serve_instance"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        if RAY_FIXTURES.intersection(names) or item.path.name == "test_cli_serve.py":  # each starts `conveyor serve`
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def quantized_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama as if converted from a GGUF: linears in Q4_1 blocks (the LM head Q8_0), and the fp32
    checkpoint holding exactly what those blocks dequantize to."""
    from tests.tiny_model import quantize_copy

    return quantize_copy(tiny_model_dir, tmp_path_factory.mktemp("tiny-gguf"))


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-qwen"), qkv_bias=True)


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[str]:
    """The Serve proxy's base URL (http://127.0.0.1:PORT). Ray and Serve start once per session (~15-25 s on 2
    cores; each package used to pay it), or attach to a Serve already running, left alone then. Every test
    deploys its own application under its own route and deletes it, so packages do not see each other's."""
    from tests.router.conftest import attached_or_new_serve

    with attached_or_new_serve() as url:
        yield url
