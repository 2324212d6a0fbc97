"""`speedkv eval`: what a method costs in quality. Needle retrieval (needles.py), fidelity to
full attention under teacher forcing (fidelity.py) and short-prompt sanity (sanity.py), run by
runner.py over methods x tasks x lengths x samples and reported by report.py."""
