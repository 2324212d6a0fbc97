"""`speedkv eval`: what a method costs in quality. A task is a `Task` (task.py) registered by
name (tasks.py), in one module with how its samples are built and scored: needle retrieval
(needles.py), fidelity to full attention under teacher forcing (fidelity.py), short-prompt
sanity (sanity.py), one cached document asked several questions (reuse.py) and RULER
(ruler.py). runner.py runs the registered tasks over methods x tasks x lengths x samples and
report.py puts their reports together; neither names a task."""
