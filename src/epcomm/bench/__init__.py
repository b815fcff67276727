"""``epcomm bench``: every dispatch/combine path timed side by side with the reference backend.

Modules: ``cases`` (named shapes), ``accounting`` (logical and link bytes), ``oracle`` (the reference's
results each timed call is checked against), ``timing`` (wall clock, CUDA events, CUDA-graph
replays), ``workloads`` (inputs, timed operations, correctness checks), ``peer`` (copy-engine
ceiling), ``runner`` (per-rank worker and the parent's driver), ``report`` (environment, JSONL rows),
``table`` (the printed header, table and closing summary: each path against its peer), ``plot`` (PNGs,
needs ``epcomm[plot]``), ``progress``, ``ab`` (two source trees alternated run by run: ``epcomm bench --ab``).

Importing this package defines names only; nothing touches a device until a benchmark runs.
"""
