"""The executor service: runs batches of a model repository on ONNX Runtime."""
