"""`speedkv bench`: TTFT, TPOT, KV memory and FLOPs per method and prompt length, against
the machine's measured limits. measure/ holds `speedkv measure`'s measurements."""
