"""`duet bench`'s load generator: seeded workloads, arrival processes, a runner that drives requests
through the gRPC client and records every token's arrival, vLLM-defined metrics, tables, JSON and
plots. Nothing here imports torch; matplotlib is imported only when plots are drawn."""
