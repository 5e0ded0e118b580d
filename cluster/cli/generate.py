"""`duet generate`: one completion from the cluster, streamed to stdout.

    duet generate "Once upon a time" --max-tokens 32 --temperature 0
    echo "prompt from stdin" | duet generate - --json
    duet generate --chat '[{"role": "user", "content": "hi"}]'      # a conversation (JSON)
    duet generate --chat --message system="be brief" --message user=hi

The text goes to stdout as it arrives and a one-line summary (finish reason, token counts, TTFT,
total time) to stderr; --json prints every response message as one JSON object per line instead.
On a terminal, control characters in the text are written escaped (`\x1b`), never raw: a model's
output must not move the cursor, retitle the window or hide text. Piped, the text is as generated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import unicodedata
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict

from cluster.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_old_spelling,
    add_target_options,
    connect,
    rpc_failure,
    setup_logging,
)
from cluster.client import ClientConfigError, Delta, DuetClient, DuetError, build_generate_request


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a completion from the cluster, streamed to stdout",
        description="Stream a completion to stdout; a one-line summary goes to stderr.",
    )
    parser.add_argument(
        "prompt", metavar="PROMPT", nargs="?", default=None,
        help='the prompt text ("-" reads it from stdin); with --chat, the messages as JSON',
    )
    parser.add_argument(
        "--chat", action="store_true",
        help="the prompt is a conversation, rendered with the served model's chat template",
    )
    parser.add_argument(
        "--message", action="append", default=[], metavar="ROLE=TEXT",
        help="a chat message (repeatable, in order; implies --chat)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate at most (16)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T", help="0 is greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass, in (0, 1] (server default 1.0)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens (server default: off)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="the same seed gives the same tokens (default: unseeded)")
    parser.add_argument("--stop", action="append", default=[], metavar="STR", help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    parser.add_argument(
        "--request-timeout", dest="timeout", type=float, default=None, metavar="S",
        help="end the request after S seconds (default: no limit)",
    )
    add_old_spelling(parser, "--timeout", "--request-timeout", "timeout", type=float)
    parser.add_argument("--json", action="store_true", help="print each response message as one JSON object per line")
    add_target_options(parser)
    parser.set_defaults(handler=run)


def chat_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    """--message ROLE=TEXT flags, else the prompt argument as a JSON list of {"role", "content"}."""
    if args.message:
        if args.prompt is not None:
            raise CliError("give the conversation as --message flags or as JSON, not both", EXIT_USAGE)
        messages = []
        for flag in args.message:
            role, separator, text = flag.partition("=")
            if not separator or not role:
                raise CliError(f"--message {flag!r}: expected ROLE=TEXT", EXIT_USAGE)
            messages.append({"role": role, "content": text})
        return messages
    raw = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    try:
        messages = json.loads(raw)
    except ValueError as error:
        raise CliError(f"--chat: the messages are not JSON ({error})", EXIT_USAGE) from None
    valid = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not valid:
        raise CliError('--chat: expected a JSON list of {"role": ..., "content": ...}', EXIT_USAGE)
    return messages


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.chat or args.message:
        prompt: Any = chat_messages(args)
    elif args.prompt is None:
        raise CliError("a PROMPT is required (or --chat / --message)", EXIT_USAGE)
    else:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        request = build_generate_request(
            prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout,
        )
    except ClientConfigError as error:
        raise CliError(str(error), EXIT_USAGE) from None
    with connect(args) as client:
        try:
            if args.json:
                _generate_json(client, request, sys.stdout)
            else:
                _generate_text(client, request, sys.stdout, sys.stderr)
        except DuetError as error:
            raise rpc_failure(error, args.target) from None
    return EXIT_OK


def _generate_json(client: DuetClient, request: Any, out: TextIO) -> None:
    for response in client.generate_raw(request):
        out.write(json.dumps(MessageToDict(response), separators=(",", ":")) + "\n")
        out.flush()


def _generate_text(client: DuetClient, request: Any, out: TextIO, err: TextIO) -> None:
    started_s = time.monotonic()
    first_token_s: float | None = None
    wrote_text = False
    terminal = out.isatty()
    result = None
    try:
        for event in client.generate_request(request):
            if not isinstance(event, Delta):
                result = event  # always the last event
                continue
            if event.token_ids and first_token_s is None:
                first_token_s = time.monotonic() - started_s
            if event.text:
                out.write(printable(event.text) if terminal else event.text)
                out.flush()
                wrote_text = True
    finally:
        if wrote_text:
            out.write("\n")
            out.flush()
    total_s = time.monotonic() - started_s
    assert result is not None, "generate_request ends with a Result or raises"
    ttft = f"{first_token_s:.3f}s" if first_token_s is not None else "-"
    stop = f" ({result.stop_reason!r})" if result.stop_reason is not None else ""
    err.write(
        f"[{result.request_id}] finish={result.finish_reason or '-'}{stop} "
        f"tokens={result.usage.completion_tokens} prompt={result.usage.prompt_tokens} "
        f"cached={result.usage.cached_tokens} ttft={ttft} total={total_s:.3f}s\n"
    )
    err.flush()


_KEPT_CONTROLS = frozenset("\n\t")


def printable(text: str) -> str:
    """`text` with its control characters (C0, DEL, C1; newline and tab kept) written as escapes."""
    if all(ch in _KEPT_CONTROLS or unicodedata.category(ch) != "Cc" for ch in text):
        return text
    return "".join(
        ch if ch in _KEPT_CONTROLS or unicodedata.category(ch) != "Cc" else ascii(ch)[1:-1] for ch in text
    )
