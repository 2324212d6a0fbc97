"""The seam to transformers and peft: a model's pieces for our own decoder loop
(`backbone`), loading models and adapters, and text in and out."""
