"""One file per method; importing this package registers them all with the policy registry."""

from . import full, speed  # noqa: F401
