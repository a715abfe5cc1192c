"""batchline: a gRPC serving mesh for ONNX models."""
