"""One file per method; importing this package registers them all with the policy registry."""

from . import (  # noqa: F401
    fastkv,
    full,
    gemfilter,
    h2o,
    pop,
    pyramidinfer,
    snapkv,
    specprefill,
    speed,
    streamingllm,
    swiftkv,
)
