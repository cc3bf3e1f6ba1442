from __future__ import annotations

import pytest

from tests.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-qwen"), qkv_bias=True)
