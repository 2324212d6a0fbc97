"""The RULER leaderboard (`speedkv leaderboard run|render`): speedkv's methods and kvpress's
presses on the same RULER samples, and the boards under benchmarks/ruler/ and
benchmarks/ruler-served/.

plans.py says what each board measures (a Plan per model and length) and its sweeps; lanes.py
runs the sweeps' parts side by side; archives.py keeps each part's answers beside its board;
rows.py reads the runs into rows (one per method, adapter, setting and length); published.py
reads and writes a board's published rows; tables.py and plot.py draw them; render.py writes a
board; run.py puts a run together; served.py is the served board's comparison, and
served_run.py makes that board (`speedkv measure ruler-served`); paired_gaps.py compares two
runs' rows with the board's paired margins (`speedkv measure paired-gaps`). kvpress runs in its
own environment, so its half stays a script (benchmarks/kvpress_peer.py) run by path.
"""
