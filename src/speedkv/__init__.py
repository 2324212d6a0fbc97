"""speedkv: SPEED (Shallow Prefill, dEEp Decode) and peer KV-cache methods for fast
long-context inference.

Where things are: `core/` runs a method (engine, prefill, cache, policy interface), `methods/`
holds one file per method (SPEED is `methods/speed.py`), `hf/` is the only code that touches
transformers' internals, and `analysis/`, `bench/`, `evals/`, `train/`, `server/`, `cli/` are
the tools and faces built on them.
"""

# _openmp first: it sets OpenMP's spin count before torch loads; methods registers every method
from speedkv import _openmp, methods  # noqa: F401
from speedkv.core.engine import Engine, Generation, Request
from speedkv.core.prefix import CachedPrefix, PrefixCache
from speedkv.core.prefix_file import load_prefix, save_prefix
from speedkv.core.registry import MethodSpec, make_policy, method_names, parse_spec
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.loading import load_model
from speedkv.version import __version__

__all__ = [
    "CachedPrefix",
    "Engine",
    "Generation",
    "MethodSpec",
    "PrefixCache",
    "Request",
    "SamplingParams",
    "UserError",
    "__version__",
    "load_model",
    "load_prefix",
    "make_policy",
    "method_names",
    "parse_spec",
    "save_prefix",
]
