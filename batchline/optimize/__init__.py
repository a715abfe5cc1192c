"""`batchline optimize`: quantized and FP16 variants of a model, an accuracy gate against FP32,
their speed measured here, and the fastest that passes written as the next version (run.py).

Light on import (the command line reads the names below); the work is in the modules."""

VARIANTS = ("graph", "int8-dynamic", "int8-static", "fp16", "tensorrt-int8")
DEFAULT_VARIANTS = VARIANTS
# A variant is written only if it serves at least this much more than FP32 (by default): less is
# within the noise of a shared host, and not worth a version.
MIN_GAIN = 1.05
