"""The model cache under processes started together: an embedded GGUF is converted once, and
nobody reads a half-written directory (two commands, or pytest-xdist workers, start at once)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from speedkv.errors import UserError
from speedkv.hf import loading

from helpers import header_only_gguf


@pytest.fixture
def llama_gguf(tmp_path, monkeypatch):
    """A GGUF that declares a Llama (header only), with a fresh cache for its conversion."""
    monkeypatch.setenv("SPEEDKV_CACHE", str(tmp_path / "cache"))
    return header_only_gguf(tmp_path / "tiny-llama.gguf", "llama")


def test_conversions_started_together_write_once(llama_gguf, monkeypatch):
    writes = []

    def slow_conversion(path, target):  # stands in for the dequantisation: files, then a rename
        writes.append(target)
        staging = target.with_name(target.name + ".partial")
        staging.mkdir()
        (staging / "config.json").write_text("{}")
        time.sleep(0.5)  # a reader without the lock would find config.json and no weights
        (staging / "model.safetensors").write_bytes(b"weights")
        staging.rename(target)

    monkeypatch.setattr(loading, "_write_hf_directory", slow_conversion)
    with ThreadPoolExecutor(3) as pool:
        directories = list(pool.map(lambda _: loading.convert_gguf(llama_gguf, False), range(3)))
    assert len(writes) == 1
    assert directories == [writes[0]] * 3
    assert (writes[0] / "model.safetensors").read_bytes() == b"weights"


def test_waiting_too_long_for_another_conversion_is_one_sentence(llama_gguf, monkeypatch):
    release = threading.Event()

    def stuck_conversion(path, target):
        release.wait(10)

    monkeypatch.setattr(loading, "_write_hf_directory", stuck_conversion)
    monkeypatch.setattr(loading, "CONVERSION_LOCK_TIMEOUT", 0.3)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(loading.convert_gguf, llama_gguf, False)
        time.sleep(0.2)  # let it take the lock
        with pytest.raises(UserError, match="another process has been converting tiny-llama"):
            loading.convert_gguf(llama_gguf, False)
        release.set()
        first.result()


def recorded_conversions(monkeypatch) -> list:
    """Conversions that write a directory (config and weights), each target recorded."""
    writes = []

    def conversion(path, target):
        writes.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(path.read_bytes())

    monkeypatch.setattr(loading, "_write_hf_directory", conversion)
    return writes


def test_copies_of_one_file_share_one_conversion(llama_gguf, tmp_path, monkeypatch):
    """Another environment's copy of the embedded file, or a reinstall, is the same model."""
    writes = recorded_conversions(monkeypatch)
    elsewhere = tmp_path / "other-venv" / llama_gguf.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(llama_gguf.read_bytes())  # another path, inode and mtime
    assert loading.convert_gguf(llama_gguf, False) == loading.convert_gguf(elsewhere, False)
    assert len(writes) == 1


def test_a_changed_file_converts_anew(llama_gguf, monkeypatch):
    writes = recorded_conversions(monkeypatch)
    first = loading.convert_gguf(llama_gguf, False)
    llama_gguf.write_bytes(llama_gguf.read_bytes() + b"\0")  # new bytes in the same place
    second = loading.convert_gguf(llama_gguf, False)
    assert first != second and writes == [first, second]
    assert (second / "model.safetensors").read_bytes() == llama_gguf.read_bytes()


def test_a_conversion_names_the_model_class_vllm_reads(llama_gguf, monkeypatch):
    """transformers' GGUF loader leaves `architectures` out of config.json, and vLLM then takes
    Gemma 3's text model for an embedding model: the conversion writes it, once, also into a
    directory converted before it did (no marker yet)."""
    import json

    def conversion(path, target):  # an older conversion: no architectures, no marker
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"model_type": "llama"}')
        (target / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(loading, "_write_hf_directory", conversion)
    directory = loading.convert_gguf(llama_gguf, False)
    assert not (directory / loading.CONVERSION_CHECKED).exists()
    assert loading.convert_gguf(llama_gguf, False) == directory  # completes it
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (directory / loading.CONVERSION_CHECKED).is_file()
