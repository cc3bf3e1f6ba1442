"""The per-replica engine. Never imports ray."""
import importlib

from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.request import SamplingParams

__all__ = ["LLM", "AsyncEngine", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "GenerationResult", "QueueFullError"]

# Imported on first use, so importing config does not pull torch and the model code.
_LAZY = {"LLM": "llm", "GenerationResult": "llm", "LLMEngine": "engine", "AsyncEngine": "async_engine",
         "QueueFullError": "scheduler"}


def __getattr__(name: str):  # noqa: ANN202 - whichever object the name stands for
    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"conveyor.serving.{_LAZY[name]}"), name)
