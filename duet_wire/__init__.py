"""Generated protobuf and gRPC stubs of duet's wire contracts (source: proto/). Do not edit."""
