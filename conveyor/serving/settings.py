"""Flat engine settings: the one table from a flat key to an EngineConfig field, and the per-surface defaults.

A deployment's YAML `args`, the `conveyor` flags and `LLM(...)`'s keywords name engine settings by flat keys
(`max_num_seqs`, `num_kv_blocks`), as vLLM's do. Each key is an EngineConfig field, found in its section
(model, cache, scheduler, or the EngineConfig itself) under the same name, except for the renames in RENAMES.
Types, defaults and help text come from the dataclasses (conveyor/serving/config.py); nothing here repeats them.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

# Section name in EngineConfig -> its dataclass; "" is EngineConfig's own fields. The order is the docs' order.
SECTIONS: dict[str, type] = {"model": ModelConfig, "scheduler": SchedulerConfig, "cache": CacheConfig,
                             "": EngineConfig}
# Flat keys whose dataclass field has another name: the flat name is vLLM's (and the deployed YAML files').
RENAMES: dict[str, tuple[str, str]] = {"num_kv_blocks": ("cache", "num_blocks")}

# The defaults that differ by surface on purpose; every other default is the dataclass's, everywhere.
# - serve: the bound is per replica, and Serve's max_ongoing_requests sits just above what the engine admits, so a
#   smaller queue keeps a replica's memory and its 429s prompt; a client waiting behind 1024 requests would time out.
# - offline (`LLM`): generate() runs a whole batch to completion and no client waits on a first token, so the SLO
#   step budget and TTFT admission would only slow it down or refuse its own prompts.
# `conveyor generate` runs one prompt with the engine's defaults.
SURFACE_DEFAULTS: dict[str, dict[str, Any]] = {
    "serve": {"max_waiting_requests": 256},
    "offline": {"tpot_slo_ms": None, "ttft_slo_ms": None},
    "generate": {},
}


@dataclass(frozen=True)
class EngineKey:
    """One flat engine setting and where it lives."""

    key: str
    section: str  # "" for EngineConfig's own fields
    field: str
    annotation: Any  # the resolved type, e.g. int | None
    default: Any  # the dataclass's
    help: str
    choices: tuple[str, ...] | None

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.annotation)

    @property
    def base_type(self) -> type:
        """int for `int | None`: what a flag's text converts to."""
        args = [a for a in typing.get_args(self.annotation) if a is not type(None)]
        return args[0] if args else self.annotation

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def _engine_keys() -> dict[str, EngineKey]:
    flat_name = {target: key for key, target in RENAMES.items()}
    keys: dict[str, EngineKey] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:  # EngineConfig's sections themselves
                continue
            key = flat_name.get((section, f.name), f.name)
            keys[key] = EngineKey(key, section, f.name, hints[f.name], f.default, f.metadata.get("help", ""),
                                  f.metadata.get("choices"))
    return keys


ENGINE_KEYS: dict[str, EngineKey] = _engine_keys()


def surface_defaults(surface: str) -> dict[str, Any]:
    """Every flat key's default on `surface` ("serve", "offline", "generate")."""
    return {key: spec.default for key, spec in ENGINE_KEYS.items()} | SURFACE_DEFAULTS[surface]


def engine_config_from_flat(values: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig from flat keys; a key not given takes the dataclass default. ValueError on an unknown key."""
    unknown = set(values) - set(ENGINE_KEYS)
    if unknown:
        raise ValueError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        spec = ENGINE_KEYS[key]
        sections[spec.section][spec.field] = value
    own = sections.pop("")
    return EngineConfig(**{name: SECTIONS[name](**kwargs) for name, kwargs in sections.items()}, **own)
