"""The gateway service: the public KServe v2 gRPC endpoint."""
