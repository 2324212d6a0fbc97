"""A cached prefix on disk: one safetensors file, checked in full when it is read back.

Tensors: `ids` (int64 [n], the tokens the prefix covers) and, for every layer i,
`layers.{i}.keys` / `layers.{i}.values` ([kv_heads, m_i, head_dim] in the model's dtype) and
`layers.{i}.positions` (int32 [kv_heads, m_i]): the live entries only, so a SPEED file holds
what the SPEED cache holds. Metadata (strings): the format tag and version, the speedkv
version, the model's name and fingerprint (`Backbone.fingerprint`), the canonical method
spec, the dtype, the chat messages as JSON ("null" for raw text), the layer count and KV
shape, the token count, how long the prefill took, and a SHA-256 of all of the above and
every tensor's bytes, so damage anywhere is found instead of answered with.

Reading refuses, in one sentence each, a file that is not a prefix file, another format
version, a damaged or truncated file, another model or dtype, and inconsistent contents.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from speedkv.core.cache import KVCache, LayerKV
from speedkv.core.prefix import CachedPrefix
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.hf.loading import dtype_name
from speedkv.hf.text import encode_messages
from speedkv.version import __version__

if TYPE_CHECKING:
    from speedkv.core.engine import Engine

FORMAT = "speedkv-prefix"
VERSION = "1"
MAKE_ONE = "make one with `speedkv prefill --save`"
# what can go wrong reading a file: damage safetensors finds, the OS, torch, our JSON fields
READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError, TypeError)


def save_prefix(prefix: CachedPrefix, path: str | Path, engine: Engine) -> int:
    """Write `prefix` (built by `engine`'s model) to `path`, atomically; the file's size."""
    from speedkv.core.engine import check_reusable

    path = Path(path)
    check_reusable(make_policy(prefix.method, engine.shape))  # so no layers share a buffer
    if len(prefix.cache.layers) != engine.depth:
        raise UserError(
            f"the prefix has {len(prefix.cache.layers)} layers, the model {engine.depth}"
        )
    tensors = {"ids": torch.tensor(prefix.ids, dtype=torch.long)}
    for i, layer in enumerate(prefix.cache.layers):
        tensors[f"layers.{i}.keys"] = layer.keys().contiguous().cpu()
        tensors[f"layers.{i}.values"] = layer.values().contiguous().cpu()
        tensors[f"layers.{i}.positions"] = layer.positions().contiguous().cpu()
    shape = engine.shape
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "speedkv_version": __version__,
        "model": engine.model.name,
        "model_fingerprint": engine.backbone.fingerprint(),
        "method": prefix.method,
        "dtype": dtype_name(engine.backbone.dtype),
        "messages": json.dumps(prefix.messages),
        "num_layers": str(engine.depth),
        "kv_heads": str(shape.num_kv_heads),
        "head_dim": str(shape.head_dim),
        "tokens": str(len(prefix.ids)),
        "prefill_s": f"{prefix.ttft_s:.6f}",
    }
    metadata["sha256"] = _digest(metadata, tensors)
    partial = path.with_name(path.name + ".partial")
    try:
        save_file(tensors, partial, metadata=metadata)
        partial.replace(path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise UserError(f"cannot write the prefix file '{path}' ({err.strerror or err})") from None
    return path.stat().st_size


def prefix_header(path: str | Path) -> dict[str, str]:
    """The metadata of a prefix file of the version this speedkv reads, without its tensors
    (enough to refuse a wrong file before a model loads)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"'{path}' is a directory, not a prefix file; {MAKE_ONE}")
    try:
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
    except FileNotFoundError:
        raise UserError(f"the prefix file '{path}' does not exist") from None
    except READ_ERRORS as err:
        raise UserError(_unreadable(path, err)) from None
    if metadata.get("format") != FORMAT:
        raise UserError(f"'{path}' is not a speedkv prefix file; {MAKE_ONE}")
    if metadata.get("version") != VERSION:
        raise UserError(
            f"'{path}' is a prefix file of format version {metadata.get('version')!r}; "
            f"speedkv {__version__} reads version {VERSION}"
        )
    return metadata


def load_prefix(path: str | Path, engine: Engine) -> CachedPrefix:
    """A prefix saved by `save_prefix`, ready for `engine.generate(prefix, question)`; a
    UserError unless the file is whole and was made by this model in this dtype."""
    path = Path(path)
    start = time.perf_counter()
    metadata = prefix_header(path)
    try:
        with safe_open(path, framework="pt", device=str(engine.device)) as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except READ_ERRORS as err:
        raise UserError(_unreadable(path, err)) from None
    if metadata.get("sha256") != _digest(metadata, tensors):
        raise UserError(f"'{path}' is damaged: its contents do not match their checksum")
    _check_model(path, metadata, engine)
    try:
        ids, layers, messages = _contents(metadata, tensors, engine)
    except _Inconsistent as err:
        raise UserError(f"'{path}' is inconsistent: {err}") from None
    _check_messages(path, messages, ids, engine)
    meta = {
        "path": str(path),
        "model": metadata.get("model"),
        "prefill_s": metadata.get("prefill_s"),
    }
    elapsed = time.perf_counter() - start
    return CachedPrefix(ids, metadata["method"], KVCache(layers), messages, elapsed, meta)


class _Inconsistent(Exception):
    """What is wrong inside a whole (checksum-valid) file."""


def _check_model(path: Path, metadata: dict[str, str], engine: Engine) -> None:
    """The file's model is the engine's: the same dtype (checked first: the same weights
    merged with an adapter in another dtype are other weights), then the same fingerprint."""
    saved, runs = metadata.get("dtype"), dtype_name(engine.backbone.dtype)
    if saved != runs:
        raise UserError(
            f"'{path}' was saved from the model in {saved} and this one runs in {runs}; load "
            f"the model with --dtype {saved}"
        )
    if metadata.get("model_fingerprint") != engine.backbone.fingerprint():
        raise UserError(
            f"'{path}' was saved from another model or other weights ({metadata.get('model')}) "
            f"than this one ({engine.model.name}); a cache continues only on the model, "
            "adapter and dtype that made it"
        )


def _contents(
    metadata: dict[str, str], tensors: dict[str, torch.Tensor], engine: Engine
) -> tuple[list[int], list[LayerKV], list[dict] | None]:
    """The ids, layers and messages, once every field agrees with the model and with itself."""
    from speedkv.core.engine import check_reusable

    shape = engine.shape
    layout = (metadata.get("num_layers"), metadata.get("kv_heads"), metadata.get("head_dim"))
    if layout != (str(engine.depth), str(shape.num_kv_heads), str(shape.head_dim)):
        raise _Inconsistent(f"layers, KV heads and head size {layout} do not fit the model")
    policy = make_policy(metadata["method"], shape)
    check_reusable(policy)
    if policy.spec() != metadata["method"]:
        raise _Inconsistent(f"the method '{metadata['method']}' is not a canonical spec")
    ids = _ids(tensors.get("ids"), metadata.get("tokens"), shape)
    names = {"ids"}
    layers = []
    for i in range(engine.depth):
        parts = [tensors.get(f"layers.{i}.{part}") for part in ("keys", "values", "positions")]
        layers.append(_layer(i, *parts, len(ids), engine))
        names.update(f"layers.{i}.{part}" for part in ("keys", "values", "positions"))
    if set(tensors) != names:
        raise _Inconsistent(f"unexpected tensors {sorted(set(tensors) - names)}")
    return ids, layers, _messages(metadata.get("messages"))


def _ids(ids: torch.Tensor | None, tokens: str | None, shape) -> list[int]:
    if ids is None or ids.dtype != torch.long or ids.dim() != 1 or str(ids.numel()) != tokens:
        raise _Inconsistent(f"the token ids do not match its token count {tokens}")
    if not 0 < ids.numel() <= shape.max_positions:
        raise _Inconsistent(
            f"it holds {ids.numel()} tokens; the model's context is 1 to {shape.max_positions}"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= shape.vocab_size:
        raise _Inconsistent(f"token ids fall outside the vocabulary of {shape.vocab_size}")
    return ids.tolist()


def _layer(i: int, keys, values, positions, n: int, engine: Engine) -> LayerKV:
    """Layer i as a cache layer, once its tensors fit the model and its positions are ones
    a cache can hold: the same in every head, increasing, within the prefix."""
    heads, dim, dtype = engine.shape.num_kv_heads, engine.shape.head_dim, engine.backbone.dtype
    if keys is None or values is None or positions is None:
        raise _Inconsistent(f"layer {i} lacks its keys, values or positions")
    m = keys.shape[1] if keys.dim() == 3 else -1
    for tensor in (keys, values):
        if tensor.dtype != dtype or tensor.shape != (heads, m, dim):
            raise _Inconsistent(
                f"layer {i} holds K/V of shape {tuple(tensor.shape)} in {tensor.dtype}; the "
                f"model's are [{heads}, entries, {dim}] in {dtype}"
            )
    if positions.dtype != torch.int32 or positions.shape != (heads, m):
        raise _Inconsistent(f"layer {i}'s positions do not match its keys and values")
    row = positions[0]
    inside = m == 0 or (int(row[0]) >= 0 and int(row[-1]) < n)
    if not (inside and bool((row[1:] > row[:-1]).all()) and bool((positions == row).all())):
        raise _Inconsistent(
            f"layer {i}'s positions are not increasing positions below {n}, the same in every head"
        )
    layer = LayerKV(heads, m, dim, dtype, engine.device)
    layer.extend(keys, values, row)
    return layer


def _messages(text: str | None) -> list[dict] | None:
    try:
        messages = json.loads(text) if text is not None else None
    except json.JSONDecodeError:
        messages = []
    if messages is None:
        return None
    ok = isinstance(messages, list) and messages
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise _Inconsistent("its chat messages are not a list of {role, content} objects")
    return messages


def _check_messages(path: Path, messages: list[dict] | None, ids: list[int], engine) -> None:
    """A chat prefix continues only where the model's own template gives the same tokens."""
    if messages is None:
        return
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        raise UserError(f"'{path}' holds a chat conversation and this model has no chat template")
    if encode_messages(engine.tokenizer, messages, generation_header=False).ids != ids:
        raise UserError(
            f"'{path}' was made with another tokenizer or chat template: this model's template "
            "encodes its conversation into other tokens"
        )


def _digest(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the metadata (but the digest itself) and of every tensor's name, type,
    shape and bytes."""
    digest = hashlib.sha256()
    fields = {key: value for key, value in metadata.items() if key != "sha256"}
    digest.update(json.dumps(fields, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _unreadable(path: Path, err: Exception) -> str:
    reason = (str(err).splitlines() or [type(err).__name__])[0]
    return (
        f"'{path}' is not a readable prefix file ({reason}): it is damaged, truncated or not "
        "a safetensors file"
    )
