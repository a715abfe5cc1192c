"""Generated protobuf/gRPC stubs (regenerate with `python scripts/gen_protos.py`)."""
