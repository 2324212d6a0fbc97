"""The options commands share, as typed aliases: one name, help text and check per thing, so
`--max-new-tokens` means the same in `generate`, `bench` and `diagnose`.

Values are checked while the arguments are parsed, before any model loads; a bad one ends as
click's one line "Invalid value for '--x': <what is wrong and what is allowed>"."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, NamedTuple, TypeVar

import typer

from speedkv.cli.common import ModelArgs
from speedkv.core.registry import MethodSpec, parse_spec
from speedkv.errors import UserError

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

MODEL_HELP = (
    "Embedded model name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m), "
    "HF directory or .gguf file."
)
METHOD_HELP = (
    "Method spec, e.g. 'full' or 'speed:lcut=22,anchors=bos' (docs/methods.md lists every "
    "method's options)."
)
METHODS_HELP = (
    "Method specs separated by ';', e.g. 'speed:lcut=22,anchors=bos;snapkv'; full is always "
    "added (the reference)."
)
THREADS_HELP = (
    "CPU threads for torch (0 = torch's default). On a CPU shared with other jobs, 1 is often "
    "faster than oversubscribed cores."
)
MAX_THREADS = 1024
MAX_SEED = 2**32 - 1  # numpy's limit, which the Trainer's seeding hits


# -- parsers ---------------------------------------------------------------------------------
def option_parser(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as a typer parser. Its UserError becomes click's BadParameter: typer would print
    a plain ValueError with pydantic's "Value error," in front."""

    def parser(value: Any) -> T:
        if not isinstance(value, str):  # a default given already parsed
            return value
        try:
            return parse(value)
        except UserError as err:
            raise typer.BadParameter(str(err)) from None

    return parser


def count(name: str, least: int, most: int | None = None, rule: str = "") -> Callable[[str], int]:
    """A parser of whole numbers from `least` to `most`; `rule` words the range for errors."""
    rule = rule or (f"at least {least}" if most is None else f"between {least} and {most}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"{name} must be a whole number, got '{text}'") from None
        if value < least or (most is not None and value > most):
            raise UserError(f"{name} must be {rule}, got {value}")
        return value

    return parse


def parsed_option(*flags: str, parse: Callable[[str], Any], metavar: str, help: str) -> Any:
    """A typer option whose value `parse` checks and converts while arguments are parsed."""
    return typer.Option(*flags, metavar=metavar, parser=option_parser(parse), help=help)


def count_option(flag: str, *aliases: str, least: int, help: str, **range_: Any) -> Any:
    """An option of whole numbers in `count`'s range (most=, rule=), named after the flag."""
    parse = count(flag.removeprefix("--"), least, **range_)
    return parsed_option(flag, *aliases, parse=parse, metavar="N", help=help)


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise UserError(f"lengths must be comma-separated token counts, got '{text}'") from err
    if not lengths or any(n < 16 for n in lengths):
        raise UserError(f"lengths must be token counts of at least 16, got '{text}'")
    return lengths


def split_commas(text: str) -> list[str]:
    """The items of a ','-separated list, stripped, empty ones dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def split_methods(text: str) -> list[str]:
    """The specs of a ';'-separated list, unchecked."""
    methods = [m.strip() for m in text.split(";") if m.strip()]
    if not methods:
        raise UserError("give at least one method, e.g. --methods 'full;speed:lcut=22,anchors=bos'")
    return methods


def parse_methods(text: str) -> list[MethodSpec]:
    return [parse_spec(m) for m in split_methods(text)]


def parse_dtype(text: str) -> str:
    import torch

    from speedkv.hf.loading import resolve_dtype

    resolve_dtype(text, torch.device("cpu"))  # the loader's own check, so the two cannot drift
    return text


def parse_weights(text: str) -> str:
    from speedkv.hf.int8 import check_weights

    return check_weights(text)


BACKENDS = ("speedkv", "vllm")


def parse_backend(text: str) -> str:
    if text not in BACKENDS:
        raise UserError(f"backend must be {' or '.join(BACKENDS)}, got '{text}'")
    return text


def parse_device(text: str) -> str:
    import torch

    from speedkv.hf.loading import resolve_device

    device = resolve_device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device '{text}' needs a CUDA GPU and this machine has none; use cpu")
    return text


def parse_out_dir(text: str) -> Path:
    """A directory that exists or can be made: no file (or link to nothing) in its way."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.is_symlink() and not part.exists():
            raise UserError(f"'{part}' is a link to nothing; give a directory for the results")
        if part.exists():
            if not part.is_dir():
                raise UserError(f"'{part}' is a file; give a directory for the results")
            break
    return path


def parse_new_file(text: str) -> Path:
    """A file to write: its directory exists, and no directory stands at its name."""
    path = Path(text)
    if not text.strip():
        raise UserError("the file name is empty; give a file to write")
    if path.is_dir():
        raise UserError(f"'{text}' is a directory; give a file name to write")
    if not path.resolve().parent.is_dir():
        raise UserError(f"the directory of '{text}' does not exist")
    return path


def parse_prefix_file(text: str) -> Path:
    from speedkv.core.prefix_file import prefix_header

    prefix_header(text)  # a file that is not a prefix file fails before any model loads
    return Path(text)


def parse_adapter(text: str) -> Path:
    from speedkv.hf.adapters import read_adapter_info

    read_adapter_info(text)  # a directory without an adapter fails before any model loads
    return Path(text)


# -- the shared options ----------------------------------------------------------------------
Model = Annotated[str, typer.Option("--model", "-m", metavar="MODEL", help=MODEL_HELP)]
Method = Annotated[
    MethodSpec, parsed_option("--method", parse=parse_spec, metavar="SPEC", help=METHOD_HELP)
]
Methods = Annotated[
    Sequence[MethodSpec],
    parsed_option("--methods", parse=parse_methods, metavar="SPECS", help=METHODS_HELP),
]
Weights = Annotated[
    str,
    parsed_option(
        "--weights",
        parse=parse_weights,
        metavar="WEIGHTS",
        help="native: linear weights as loaded; int8: weight-only int8 (one scale per row), "
        "which speeds up decode where reading weights dominates (docs/int8.md).",
    ),
]
Prepack = Annotated[
    bool,
    typer.Option(
        "--prepack/--no-prepack",
        help="Decode with a copy of the linear weights packed for one-row products (CPU): "
        "speedkv's kernel for bfloat16 and int8 weights where the CPU has AVX512-BF16 or AVX2, "
        "oneDNN's layout for other float32 or bfloat16 weights; faster decode for a second "
        "copy of those weights in memory (docs/engine.md).",
    ),
]
Backend = Annotated[
    str,
    parsed_option(
        "--backend",
        parse=parse_backend,
        metavar="ENGINE",
        help="speedkv: speedkv's own engine (every method); vllm: vLLM with speedkv's SPEED "
        "plugin (full and speed; needs vLLM installed: make vllm-venv; docs/vllm.md).",
    ),
]
VllmArg = Annotated[
    list[str] | None,
    typer.Option(
        "--vllm-arg",
        metavar="ARG",
        help="With --backend vllm: one more vLLM engine flag (repeatable), e.g. "
        "--vllm-arg=--tensor-parallel-size=3 or --vllm-arg=--pipeline-parallel-size=2. "
        "Options SPEED cannot run are refused with one sentence (docs/vllm.md).",
    ),
]
Dtype = Annotated[
    str,
    parsed_option(
        "--dtype",
        parse=parse_dtype,
        metavar="DTYPE",
        help="Weights and activations: auto (bfloat16 where it is fast), float32 or bfloat16.",
    ),
]
Device = Annotated[
    str,
    parsed_option(
        "--device",
        parse=parse_device,
        metavar="DEVICE",
        help="Where the model runs: auto (a GPU if there is one), cpu or cuda.",
    ),
]
Threads = Annotated[
    int,
    count_option(
        "--threads",
        least=0,
        most=MAX_THREADS,
        rule=f"0 (torch's default) or a count up to {MAX_THREADS}",
        help=THREADS_HELP,
    ),
]
Adapter = Annotated[
    Path | None,
    parsed_option(
        "--adapter",
        parse=parse_adapter,
        metavar="DIR",
        help="LoRA adapter directory from `speedkv train`, merged into the model.",
    ),
]
Raw = Annotated[
    bool, typer.Option("--raw", help="Use the prompt as raw text, without the chat template.")
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print the result as JSON on stdout (logs go to stderr).")
]
MaxNewTokens = Annotated[
    int,
    count_option("--max-new-tokens", "-n", least=1, help="Most tokens to generate per prompt."),
]
ContinuationTokens = Annotated[
    int,
    count_option(
        "--continuation-tokens",
        least=1,
        help="Tokens of the text after each prompt, teacher-forced and compared with full "
        "attention.",
    ),
]
Seed = Annotated[int | None, count_option("--seed", least=0, most=MAX_SEED, help="Random seed.")]
Samples = Annotated[
    int | None,
    count_option("--samples", least=1, help="How many prompts or passages to measure on."),
]
PromptTokens = Annotated[
    int, count_option("--prompt-tokens", least=1, help="Length of the built-in prompts in tokens.")
]
Lengths = Annotated[
    Sequence[int],
    parsed_option(
        "--lengths",
        parse=parse_lengths,
        metavar="N,N,...",
        help="Prompt lengths in tokens, separated by commas.",
    ),
]
OutDir = Annotated[
    Path,
    parsed_option(
        "--out",
        "-o",
        parse=parse_out_dir,
        metavar="DIR",
        help="Directory for the results (made if missing).",
    ),
]
PromptFile = Annotated[
    Path | None,
    typer.Option("--prompt-file", metavar="FILE", help="Read the prompt from a UTF-8 text file."),
]
SaveFile = Annotated[
    Path,
    parsed_option(
        "--save",
        parse=parse_new_file,
        metavar="FILE",
        help="Where to write the cache (a safetensors file; replaced if it exists).",
    ),
]
LoadFile = Annotated[
    Path | None,
    parsed_option(
        "--load",
        parse=parse_prefix_file,
        metavar="FILE",
        help="Continue a cache saved by `speedkv prefill --save`: the prompt is the next "
        "question (chat) or text appended to it (--raw); only its new tokens are prefilled.",
    ),
]
PromptsFile = Annotated[
    Path | None,
    typer.Option(
        "--prompts-file", metavar="FILE", help="Prompts from a UTF-8 text file, one per line."
    ),
]


# -- the model options, declared once ---------------------------------------------------------
class SharedOption(NamedTuple):
    alias: Any  # the Annotated type typer reads: flags, metavar, parser, help
    default: Any  # what --help shows and a command gets when the option is not given


# every command lists the ones it takes in this order (model first)
MODEL_OPTIONS: dict[str, SharedOption] = {
    "model": SharedOption(Model, "smollm2-135m"),
    "adapter": SharedOption(Adapter, None),
    "dtype": SharedOption(Dtype, "auto"),
    "weights": SharedOption(Weights, "native"),
    "prepack": SharedOption(Prepack, True),
    "device": SharedOption(Device, "auto"),
    "threads": SharedOption(Threads, 0),
    "backend": SharedOption(Backend, "speedkv"),
    "vllm_arg": SharedOption(VllmArg, None),
}


def model_options(*names: str, before: Mapping[str, str | None] | None = None) -> Callable[[F], F]:
    """Give a command --model and the model options `names` (keys of MODEL_OPTIONS), declared
    here once. The command takes them as one `ModelArgs` in its keyword-only parameter
    `model: ModelArgs` (no default: the decorator always gives it) and names only its own
    options.

    typer lists options in the order of the signature, so where each goes is fixed: --model
    takes the place of the command's `model`, the others follow MODEL_OPTIONS' order before the
    command's own `as_json` (last if it has none). `before` starts a run of them elsewhere:
    {"adapter": "host"} puts --adapter, and the ones after it up to the next one named there,
    before the command's parameter `host`; None puts them last."""
    unknown = set(names) - MODEL_OPTIONS.keys()
    if unknown:
        raise ValueError(f"not model options: {sorted(unknown)}; MODEL_OPTIONS has the rest")
    wanted = [name for name in MODEL_OPTIONS if name == "model" or name in names]
    before = dict(before or {})
    stray = before.keys() - set(wanted[1:])
    if stray:
        raise ValueError(f"`before` names options the command does not take: {sorted(stray)}")

    def decorate(func: F) -> F:
        # evaluated, since the new signature is read as it stands (`from __future__` makes
        # every annotation a string)
        signature = inspect.signature(func, eval_str=True)
        own = signature.parameters
        if getattr(own.get("model"), "annotation", None) is not ModelArgs:
            raise TypeError(f"{func.__name__} must take its model options as `model: ModelArgs`")
        if set(wanted) & (own.keys() - {"model"}):
            raise TypeError(f"{func.__name__} declares model options of its own")
        places = _places(wanted[1:], before, own, func.__name__)

        def shared(name: str) -> inspect.Parameter:
            option = MODEL_OPTIONS[name]
            return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                     default=option.default, annotation=option.alias)  # fmt: skip

        params: list[inspect.Parameter] = []
        for name, param in own.items():
            if name == "model":
                params.append(shared("model"))
                continue
            params += [shared(other) for other in places.get(name, [])]
            # keyword-only: a required option may then follow options with defaults
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        params += [shared(other) for other in places.get(None, [])]

        @functools.wraps(func)
        def command(**values: Any) -> Any:
            given = {name: values.pop(name) for name in wanted}
            return func(**values, model=model_args(given))

        command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        # typer also reads the type hints; these must be the new parameters' own
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__annotations__["return"] = signature.return_annotation
        command.model_options = tuple(wanted)  # type: ignore[attr-defined]  # read by tests
        return command  # type: ignore[return-value]

    return decorate


def _places(
    names: list[str], before: dict[str, str | None], own: Mapping[str, Any], command: str
) -> dict[str | None, list[str]]:
    """The model options (but --model) that go before each of the command's own parameters
    (None: last), in runs started by `before`."""
    place = "as_json" if "as_json" in own else None
    places: dict[str | None, list[str]] = {}
    for name in names:
        place = before.get(name, place)
        if place is not None and place not in own:
            raise TypeError(f"{command} has no parameter '{place}' to put --{name} before")
        places.setdefault(place, []).append(name)
    return places


def model_args(given: Mapping[str, Any]) -> ModelArgs:
    """The model options a command was given as one ModelArgs; those it does not take keep
    ModelOptions' defaults (e.g. no prepacking where a command has no --prepack)."""
    from speedkv.hf.build import ModelOptions

    fields = {field.name for field in dataclasses.fields(ModelOptions)}
    options = ModelOptions(**{name: value for name, value in given.items() if name in fields})
    extra = {name: given[name] for name in ("threads", "backend") if name in given}
    return ModelArgs(options, vllm_args=list(given.get("vllm_arg") or []), **extra)
