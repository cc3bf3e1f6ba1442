"""The per-replica engine. Never imports ray."""
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.request import SamplingParams

__all__ = ["LLM", "AsyncEngine", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "GenerationResult", "QueueFullError"]


def __getattr__(name: str):  # noqa: ANN202 - lazy, so importing config does not pull torch and the model code
    if name in ("LLM", "GenerationResult"):
        from conveyor.serving import llm
        return getattr(llm, name)
    if name == "LLMEngine":
        from conveyor.serving.engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from conveyor.serving.async_engine import AsyncEngine
        return AsyncEngine
    if name == "QueueFullError":
        from conveyor.serving.scheduler import QueueFullError
        return QueueFullError
    raise AttributeError(name)
