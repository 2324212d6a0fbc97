"""`speedkv measure NAME`: the measurements behind benchmarks/'s figures that run in speedkv's
own environment, one module each, with its own argparse options. Scripts that need another
environment (vLLM's, kvpress's, llama.cpp's, OpenVINO's) stay under benchmarks/.

Each module has `main(argv)` and runs as `python -m MODULE` too. The registry names modules as
strings, imported only when a measurement runs: most import torch or a model, and the list
must not load them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from speedkv.errors import UserError

# command name -> module; ruler-served renders a leaderboard and paired-gaps takes its margins,
# so both live in that layer (a string here, never an import: bench stays below the leaderboard)
MEASUREMENTS: dict[str, str] = {
    "decode-attention": "speedkv.bench.measure.decode_attention",
    "decode-breakdown": "speedkv.bench.measure.decode_breakdown",
    "decode-layer-ab": "speedkv.bench.measure.decode_layer_ab",
    "decode-linear": "speedkv.bench.measure.decode_linear",
    "int8-decode": "speedkv.bench.measure.int8_decode",
    "kernel-paths-ab": "speedkv.bench.measure.kernel_paths_ab",
    "loadtest": "speedkv.bench.measure.loadtest",
    "paired-gaps": "speedkv.leaderboard.paired_gaps",
    "prefill-attention": "speedkv.bench.measure.prefill_attention",
    "prefill-chunks": "speedkv.bench.measure.prefill_chunks",
    "prefix-ttft": "speedkv.bench.measure.prefix_ttft",
    "ruler-haystack-overlap": "speedkv.bench.measure.ruler_haystack_overlap",
    "ruler-served": "speedkv.leaderboard.served_run",
}


def _module(name: str) -> str:
    if name not in MEASUREMENTS:
        raise UserError(
            f"no measurement named {name!r}; the measurements are: {', '.join(MEASUREMENTS)}"
        )
    return MEASUREMENTS[name]


def load_main(name: str) -> Callable[[list[str] | None], None]:
    """The `main(argv)` of measurement `name`, its module imported now."""
    module = _module(name)
    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "speedkv":
            raise  # a bug, not a missing dependency
        raise UserError(
            f"speedkv measure {name} needs the Python module {err.name!r}, which is not "
            "installed in this environment"
        ) from err


def summary(name: str) -> str:
    """The first paragraph of measurement `name`'s docstring on one line, read from its
    source file without importing it."""
    spec = importlib.util.find_spec(_module(name))
    if spec is None or spec.origin is None:
        return ""
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())
