"""speedkv: SPEED (Shallow Prefill, dEEp Decode) and peer KV-cache methods for fast
long-context inference. SPEED itself lives in `speedkv/methods/speed.py`."""

from .engine import Engine, Generation, Request
from .errors import UserError
from .models import load_model
from .policy import make_policy, method_names
from .sampling import SamplingParams

__all__ = [
    "Engine",
    "Generation",
    "Request",
    "SamplingParams",
    "UserError",
    "load_model",
    "make_policy",
    "method_names",
]
__version__ = "0.1.0"
