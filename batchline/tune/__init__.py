"""`batchline tune MODEL`: each layout of one executor for a model (instance_count x threads per
instance x max_batch_size, each version the repository holds) measured through a real mesh on
this host by goodput within the budget, and the best written into the model's config.toml
(run.py).

Light on import (the command line reads the names below); the work is in the modules."""

# A layout replaces the current one only if it serves at least this much more within the budget:
# less is within the noise of a shared host.
MIN_GAIN = 1.05
# Requests kept in flight while a layout is measured.
CONCURRENCY = 32
MEASURE_S = 5.0
WARMUP_S = 2.0
# Side-by-side rounds of the finalists (the current layout and the others that served most in the
# search's single runs), each judged by the median of its ratios to the current one.
ROUNDS = 3
FINALISTS = 3
