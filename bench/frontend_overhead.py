"""What the OpenAI HTTP front end costs next to the gRPC one: the same short requests (16 prompt
tokens, 4 output tokens, greedy, streamed) through gRPC and through HTTP, against one router backed
by instant in-process instances (worker/instant.py: no model, so the front end is what is
measured), side by side, at concurrency 1 and 32.

    python bench/frontend_overhead.py [--quick] [--requests N] [--rounds R]

This process serves: the router, the gRPC front end and the HTTP front end on one event loop, as
`duet serve` runs them. The load generator is a separate process (this script with --client), so
the client's own cost does not share the server's interpreter: a raw grpc.aio stream per request
over one channel, and for HTTP a minimal keep-alive HTTP/1.1 client per concurrent worker (SSE,
`stream: true`). TTFT is from sending the request to the first token message (gRPC TokenDelta,
HTTP `data:` chunk). Backends alternate round by round; each figure is the median over rounds.

Targets: HTTP requests/s >= 0.8 x gRPC's at concurrency 32 (`http_vs_grpc_rps_ratio_c32`), and
HTTP TTFT p50 <= gRPC's + 2 ms at concurrency 1 (`http_minus_grpc_ttft_p50_ms_c1`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Target, emit_result, print_table, progress  # noqa: E402

PROMPT = tuple(range(1, 17))  # 16 tokens
MAX_TOKENS = 4
MODEL = "duet-default"
CONCURRENCIES = (1, 32)


# ---- the load generator (a process of its own) ---------------------------------------------------


async def _grpc_round(target: str, requests: int, concurrency: int) -> tuple[float, list[float]]:
    import grpc

    from cluster.client import build_generate_request
    from duet_wire.v1 import client_pb2 as pb

    request = build_generate_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    payload = request.SerializeToString()
    ttfts: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        generate = channel.unary_stream(
            "/duet_wire.v1.Duet/Generate", request_serializer=lambda raw: raw, response_deserializer=pb.GenerateResponse.FromString
        )
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                started = time.perf_counter()
                first = None
                async for response in generate(payload):
                    if first is None and response.HasField("delta"):
                        first = time.perf_counter() - started
                    if response.HasField("result"):
                        break
                ttfts.append(first if first is not None else float("nan"))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return requests / elapsed, ttfts


async def _http_round(port: int, requests: int, concurrency: int) -> tuple[float, list[float]]:
    body = json.dumps(
        {"model": MODEL, "prompt": list(PROMPT), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    message = head + body
    ttfts: list[float] = []
    left = requests

    async def worker() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left > 0:
                left -= 1
                started = time.perf_counter()
                writer.write(message)
                buffer = b""
                first = None
                # Chunked SSE: the stream ends with "data: [DONE]" and the zero-length chunk.
                while not (b"data: [DONE]" in buffer and buffer.endswith(b"\r\n0\r\n\r\n")):
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("the server closed the connection")
                    buffer += data
                    if first is None and b"data: {" in buffer:
                        first = time.perf_counter() - started
                if not buffer.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(buffer[:200].decode(errors="replace"))
                ttfts.append(first if first is not None else float("nan"))
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return requests / (time.perf_counter() - started), ttfts


async def run_client(grpc_target: str, http_port: int, requests: int, rounds: int) -> dict:
    results: dict[str, list] = {}
    for concurrency in CONCURRENCIES:
        count = max(concurrency * 4, requests if concurrency > 1 else requests // 4)
        # Warm both paths (connections, caches) before measuring.
        await _grpc_round(grpc_target, concurrency * 2, concurrency)
        await _http_round(http_port, concurrency * 2, concurrency)
        for _ in range(rounds):
            for backend in ("grpc", "http"):
                if backend == "grpc":
                    rps, ttfts = await _grpc_round(grpc_target, count, concurrency)
                else:
                    rps, ttfts = await _http_round(http_port, count, concurrency)
                results.setdefault(f"{backend}_c{concurrency}", []).append((rps, statistics.median(ttfts) * 1e3))
    return results


# ---- the server ----------------------------------------------------------------------------------


async def serve_and_measure(requests: int, rounds: int) -> dict:
    from cluster.frontend.http import OpenAIServer
    from cluster.frontend.service import FrontendServer
    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from cluster.router.instance_client import InstantInstanceClient
    from worker.instant import InstantInstance, InstantNetwork
    from worker.protocol import InstanceRole
    from worker.tokenizer import ByteTokenizer

    config = RouterConfig.from_dict({"admission": {"max_queued_requests": 4096}})
    router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
    await router.start()
    network = InstantNetwork()
    for name, role in (("p0", InstanceRole.PREFILL), ("g0", InstanceRole.GENERATION)):
        await router.add_instance(InstantInstanceClient(InstantInstance(name, role, network)))
    grpc_server = FrontendServer(router, port=0)
    grpc_port = await grpc_server.start()
    http_server = OpenAIServer(router, ByteTokenizer(), served_model_name=MODEL, port=0)
    http_port = await http_server.start()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", f"127.0.0.1:{grpc_port}", str(http_port), str(requests), str(rounds),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"the load generator exited with {process.returncode}")
        return json.loads(out.decode().strip().splitlines()[-1])
    finally:
        await http_server.stop(1.0)
        await grpc_server.stop(1.0)
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--client":
        target, port, requests, rounds = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        print(json.dumps(asyncio.run(run_client(target, port, requests, rounds))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--requests", type=int, default=None, help="requests per round at concurrency 32 (default 2000; 200 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per backend, alternating (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    requests = args.requests or (200 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    progress(f"frontend overhead: {requests} requests per round at c32, {rounds} round(s), gRPC vs HTTP")
    results = asyncio.run(serve_and_measure(requests, rounds))

    def median(key: str, index: int) -> float:
        return statistics.median(entry[index] for entry in results[key])

    figures: dict[str, float] = {}
    rows = []
    for concurrency in CONCURRENCIES:
        for backend in ("grpc", "http"):
            key = f"{backend}_c{concurrency}"
            figures[f"{backend}_rps_c{concurrency}"] = round(median(key, 0), 1)
            figures[f"{backend}_ttft_p50_ms_c{concurrency}"] = round(median(key, 1), 3)
            rows.append([backend, concurrency, median(key, 0), median(key, 1)])
    figures["http_vs_grpc_rps_ratio_c32"] = round(figures["http_rps_c32"] / figures["grpc_rps_c32"], 3)
    figures["http_minus_grpc_ttft_p50_ms_c1"] = round(figures["http_ttft_p50_ms_c1"] - figures["grpc_ttft_p50_ms_c1"], 3)
    figures["requests_per_round_c32"] = requests
    figures["rounds"] = rounds
    print_table(["backend", "concurrency", "requests/s", "TTFT p50 ms"], rows)
    emit_result(
        "frontend_overhead",
        figures,
        {
            "http_vs_grpc_rps_ratio_c32": Target(figures["http_vs_grpc_rps_ratio_c32"], 0.8, True),
            "http_minus_grpc_ttft_p50_ms_c1": Target(figures["http_minus_grpc_ttft_p50_ms_c1"], 2.0, False),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
