"""`full`: ordinary full attention, every token in every layer. The reference all methods
are measured against."""

from ..policy import Policy, register

register(Policy)
