"""The engine: the method interface and registry, layer-major prefill, the layer-asymmetric
KV cache, attention kernels, batched decode and sampling."""
