"""`full`: ordinary full attention, every token in every layer. The reference all methods
are measured against."""

from speedkv.core.policy import Policy
from speedkv.core.registry import register

register(Policy)
