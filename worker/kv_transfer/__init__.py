"""KV cache transfer between instances over gRPC (push from the prefill to the generation instance).

No torch or numpy at import time: the cluster imports parts of this package (auth, failures, ids).

    server = KvTransferServer(sink, ReceiverConfig(), security=TransportSecurity(token=...))
    port = server.start()
    outcome = KvSender(SenderConfig(), security=...).push("host:port", transfer_id, request_id, source, deadline_s=10.0)

The protocol is in proto/duet_wire/v1/kv_transfer.proto; faults.py documents fault injection.
"""
