"""`batchline optimize`: quantized and FP16 variants of a model, an accuracy gate against FP32,
their speed measured here, and the fastest that passes written as the next version (run.py).

Light on import (the command line reads the names below); the work is in the modules."""

VARIANTS = ("graph", "int8-dynamic", "int8-static", "fp16", "tensorrt-int8")
DEFAULT_VARIANTS = VARIANTS
