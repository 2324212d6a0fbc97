"""The engine: the method interface and registry, layer-major prefill, the layer-asymmetric
KV cache, batched decode and sampling (the kernels they run on are in speedkv.kernels)."""
