"""One file per method behind the `Policy` interface (speedkv.core.policy), plus the helpers
they share (`scoring`, `retention`, `probe`, `common`). Importing this package registers
every method with the registry; SPEED itself is `speed.py`."""

from speedkv.methods import (  # noqa: F401  (each import registers a method)
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
