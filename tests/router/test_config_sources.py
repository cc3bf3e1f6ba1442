"""One source of configuration: flags, ServeArgs keys, LLM keywords and docs/configuration.md all come from the
engine's dataclasses (conveyor/serving/settings.py); no Ray cluster needed."""
from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import yaml

from conveyor.cli import build_parser, engine_config_from_args, main
from conveyor.router.app import SERVE_ONLY_KEYS, ServeArgs
from conveyor.router.serve_cli import serve_args_from
from conveyor.serving.config import EngineConfig
from conveyor.serving.settings import (
    ENGINE_KEYS,
    SECTIONS,
    SURFACE_DEFAULTS,
    engine_config_from_flat,
    surface_defaults,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def flat_from_engine_config(config: EngineConfig) -> dict:
    """The flat keys of `config` (the inverse of engine_config_from_flat)."""
    return {key: getattr(getattr(config, spec.section) if spec.section else config, spec.field)
            for key, spec in ENGINE_KEYS.items()}


def _subparser(name: str):  # noqa: ANN202 - argparse.ArgumentParser
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[name]  # noqa: SLF001


def test_every_engine_field_has_one_flat_key_with_help() -> None:
    fields = {(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
              if f.default_factory is dataclasses.MISSING}
    assert {(spec.section, spec.field) for spec in ENGINE_KEYS.values()} == fields
    assert all(spec.help for spec in ENGINE_KEYS.values())
    assert ENGINE_KEYS["num_kv_blocks"].field == "num_blocks"
    config = engine_config_from_flat({"model": "m", "max_num_seqs": 2, "num_kv_blocks": 64})
    assert (config.model.model, config.scheduler.max_num_seqs, config.cache.num_blocks) == ("m", 2, 64)
    assert engine_config_from_flat(flat_from_engine_config(config)) == config
    assert engine_config_from_flat({}) == EngineConfig()
    with pytest.raises(ValueError, match="num_blocks"):
        engine_config_from_flat({"num_blocks": 3})  # the field name is not a flat key: num_kv_blocks is


def test_serve_args_engine_keys_map_onto_engine_config_fields() -> None:
    engine_keys = set(ServeArgs.model_fields) - set(SERVE_ONLY_KEYS)
    assert engine_keys == set(ENGINE_KEYS)
    for key in engine_keys:  # same default as the dataclass, unless the per-surface table says otherwise
        assert ServeArgs.model_fields[key].default == surface_defaults("serve")[key], key
        assert ServeArgs.model_fields[key].description == ENGINE_KEYS[key].help
    assert ServeArgs().max_waiting_requests == SURFACE_DEFAULTS["serve"]["max_waiting_requests"] == 256
    # Every key reaches its EngineConfig field.
    cfg = ServeArgs(max_num_seqs=3, num_kv_blocks=64, stream_interval=4, tpot_slo_ms=None, slo_headroom=0.5)
    engine = cfg.engine_config()
    assert (engine.scheduler.max_num_seqs, engine.cache.num_blocks, engine.stream_interval) == (3, 64, 4)
    assert (engine.scheduler.tpot_slo_ms, engine.scheduler.slo_headroom) == (None, 0.5)
    assert flat_from_engine_config(engine) == {key: getattr(cfg, key) for key in ENGINE_KEYS}


@pytest.mark.parametrize("command, surface", [("serve", "serve"), ("generate", "generate")])
def test_cli_flag_defaults_equal_the_dataclass_defaults(command: str, surface: str) -> None:
    parser = _subparser(command)
    defaults = surface_defaults(surface)
    keys = [key for key in ENGINE_KEYS if not (command == "generate" and key == "seed")]
    for key in keys:
        assert parser.get_default(key) == defaults[key], key
    for key, value in defaults.items():  # only the per-surface table differs from the dataclasses
        if key not in SURFACE_DEFAULTS[surface]:
            assert value == ENGINE_KEYS[key].default
    args = build_parser().parse_args([command] + (["hi"] if command == "generate" else []))
    expected = engine_config_from_flat({k: v for k, v in defaults.items() if k in keys})
    assert engine_config_from_args(args) == expected


def test_serve_only_flag_defaults_equal_serve_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    parser = _subparser("serve")
    flags = {a.dest for a in parser._actions if a.option_strings}  # noqa: SLF001
    checked = 0
    for key in set(SERVE_ONLY_KEYS) & flags:
        # None on purpose: `conveyor serve` then gives a single CPU replica every core, and puts one fixed
        # replica's engine in the ingress.
        if key in ("num_cpus", "engine_in_ingress"):
            assert parser.get_default(key) is None
            continue
        assert parser.get_default(key) == ServeArgs.model_fields[key].default, key
        checked += 1
    assert checked >= 6
    args = build_parser().parse_args(["serve", "--request-timeout-s", "none"])
    assert serve_args_from(args, args.serve_parser) == {"request_timeout_s": None}


def test_cli_flags_types_none_and_booleans() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--tpot-slo-ms", "none", "--max-queue-wait-s", "2.5",
                              "--no-enable-prefix-caching", "--num-kv-blocks", "64", "--no-cpu-decode-stack"])
    config = engine_config_from_args(args)
    assert config.scheduler.tpot_slo_ms is None and config.scheduler.max_queue_wait_s == 2.5
    assert not config.cache.enable_prefix_caching and config.cache.num_blocks == 64
    assert not config.cpu_decode_stack and args.seed is None  # --seed stays generate's sampling seed
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--max-num-seqs", "none"])  # not Optional: no `none`
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduling", "fifo"])


def test_llm_keywords_are_the_engine_keys_with_offline_defaults() -> None:
    from conveyor.serving.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    assert set(params) - {"self"} == set(ENGINE_KEYS)
    offline = surface_defaults("offline")
    assert all(params[key].default == offline[key] for key in ENGINE_KEYS)
    assert params["tpot_slo_ms"].default is None and params["ttft_slo_ms"].default is None
    assert params["max_waiting_requests"].default == 1024
    with pytest.raises(TypeError, match="max_num_sqs"):
        LLM("smollm2", max_num_sqs=4)  # refused before any model loads


def _print_config(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["serve", *argv]) == 0
    return capsys.readouterr().out


def test_print_config_shows_the_merged_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("--print-config started Ray")

    # (Ray may already run in this process when the whole suite runs: the check is that print-config never starts it.)
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setenv("CONVEYOR_API_KEY", "secret")
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - name: conveyor\n    import_path: conveyor.router.app:build_app\n"
                      "    args: {model: from-file, max_num_seqs: 8, num_replicas: 2, num_kv_blocks: 64}\n")
    out = _print_config(["--config", str(config), "--max-num-seqs", "4", "--print-config"], capsys)
    data = yaml.safe_load(out)
    assert (data["model"], data["max_num_seqs"], data["num_replicas"], data["num_kv_blocks"]) == (
        "from-file", 4, 2, 64)
    assert data["max_waiting_requests"] == 256 and data["api_key"] == "***"  # the key itself is not printed
    assert "secret" not in out
    assert ServeArgs.model_validate(data | {"api_key": None}).max_num_seqs == 4  # a valid --config file again
    as_json = json.loads(_print_config(["--print-config", "json", "--tpot-slo-ms", "none"], capsys))
    assert as_json["tpot_slo_ms"] is None and as_json["model"] == "smollm2"
    with pytest.raises(SystemExit):
        main(["serve", "--print-config", "--max-num-seqs", "0"])  # bad settings fail, as a real start would


def test_configuration_docs_are_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_docs", DOCS.parents[1] / "scripts" / "config_docs.py")
    config_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_docs)
    assert DOCS.read_text() == config_docs.render(), "docs/configuration.md is stale: run `make docs`"
    for key in (*ENGINE_KEYS, *SERVE_ONLY_KEYS, "request_timeout_s", "CONVEYOR_CPU_BUILD_DIR"):
        assert f"`{key}`" in DOCS.read_text()


def test_environment_variables_are_read_through_envs() -> None:
    import re

    from conveyor import envs

    root = Path(__file__).resolve().parents[2] / "conveyor"
    for path in [*root.joinpath("serving").rglob("*.py"), *root.joinpath("router").rglob("*.py")]:
        for name in re.findall(r"[\"'](CONVEYOR_[A-Z_]+)[\"']", path.read_text()):
            pytest.fail(f"{path}: {name} is named outside conveyor/envs.py")
    assert envs.get(envs.GRAMMAR_NICE, {}) == "10" and envs.get(envs.GRAMMAR_NICE, {envs.GRAMMAR_NICE: "3"}) == "3"
    documented = {var.name for var in (*envs.ENV_VARS.values(), *envs.KERNEL_ENV_VARS)}
    for path in root.joinpath("kernels").rglob("*.py"):
        for name in re.findall(r"environ\.get\(\"(CONVEYOR_[A-Z_]+)", path.read_text()):
            assert name in documented, name
