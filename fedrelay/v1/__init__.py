"""Generated gRPC/protobuf stubs for the wire contract in proto/fedrelay/v1 (do not edit)."""
