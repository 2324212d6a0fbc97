"""`full`: ordinary full attention, every token in every layer. The reference all methods
are measured against."""

from speedkv.core.policy import Policy
from speedkv.core.registry import register


@register
class Full(Policy):
    """Every hook at its full-attention default."""

    name = "full"
    degenerate_specs = ("full",)
    reusable = True  # every token is computed the same whatever follows it
