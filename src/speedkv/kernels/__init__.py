"""speedkv's CPU kernels, in one place: the C++ sources (csrc/) and the table that lists each
kernel (`catalogue`), building them for this machine (`native`), measuring which kernel runs
each kind of work (`tuning`), the configuration the engine hands down (`config`), the calls
into them with torch's kernels as the fallback (`attention`, `linear`, `int8`, `layer_ops`),
and what this CPU offers (`cpu`).

Nothing here knows transformers: hf/ patches the model's modules and calls these."""
