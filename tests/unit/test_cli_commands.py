"""`duet generate` and `duet status` run in-process (`main([...])`) against a front end on a free
loopback port: streamed text and --json, the status table and --json, exit statuses per error
class with one-line messages, connection refused."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from test_frontend_support import FakeRouter, Script, ServerThread, free_port

from cluster.cli.common import EXIT_CODES, EXIT_USAGE
from cluster.cli.main import build_parser, main
from cluster.cli.status import render_status
from cluster.router.api import ErrorKind, RouterError

pytestmark = pytest.mark.timeout(60)
TOKEN = "cli-test-token-0123456789"

SCRIPTS = {
    "stop-string": Script(tokens=(((1,), "a"), ((2,), "b")), finish_reason="stop", stop_reason="END"),
    "final-error": Script(error_kind=ErrorKind.ABORTED, error_message="KV transfer failed 3 times"),
    "busy": Script(submit_error=RouterError(ErrorKind.RESOURCE_EXHAUSTED, "admission queue is full")),
    "gone": Script(submit_error=RouterError(ErrorKind.UNAVAILABLE, "no healthy instance")),
    "late": Script(submit_error=RouterError(ErrorKind.DEADLINE_EXCEEDED, "deadline passed")),
    "controls": Script(tokens=(((27,), "\x1b[2J"), ((7,), "ok\x07\n\tend\x9b"))),
}


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeRouter(SCRIPTS)) as running:
        yield running


@pytest.fixture(scope="module")
def secured():
    with ServerThread(FakeRouter(SCRIPTS), tokens=[TOKEN]) as running:
        yield running


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_streams_text_and_a_summary(server, capsys) -> None:
    code, out, err = _run(capsys, "generate", "hello", "--target", server.target)
    assert code == 0 and out == "Hi!\n"
    (summary,) = err.strip().splitlines()
    assert "finish=length" in summary and "tokens=3" in summary and "prompt=5" in summary
    assert "ttft=" in summary and "total=" in summary and summary.startswith("[req-")


def test_generate_passes_every_option(server, capsys) -> None:
    before = len(server.router.submitted)
    code, out, err = _run(
        capsys, "generate", "stop-string", "--target", server.target, "--max-tokens", "5", "--temperature", "0",
        "--top-p", "0.5", "--top-k", "3", "--seed", "9", "--stop", "END", "--stop", "\n\n", "--ignore-eos",
        "--timeout", "4",
    )  # fmt: skip
    assert code == 0 and out == "ab\n" and "finish=stop ('END')" in err
    request = server.router.submitted[before]
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.0, 0.5, 3, 9)
    assert s.stop == ("END", "\n\n") and s.ignore_eos and request.timeout_s == 4.0


def test_generate_reads_the_prompt_from_stdin(server, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("stop-string"))
    code, out, _ = _run(capsys, "generate", "-", "--target", server.target)
    assert code == 0 and out == "ab\n"


def test_generate_json_prints_one_object_per_message(server, capsys) -> None:
    code, out, err = _run(capsys, "generate", "hello", "--json", "--target", server.target)
    assert code == 0 and err == ""
    messages = [json.loads(line) for line in out.strip().splitlines()]
    kinds = [next(k for k in m if k != "requestId") for m in messages]
    assert kinds[-1] == "result" and set(kinds[:-1]) == {"delta"}
    assert [t for m in messages[:-1] for t in m["delta"]["tokenIds"]] == [72, 105, 33]
    assert "".join(m["delta"]["text"] for m in messages[:-1]) == "Hi!"
    result = messages[-1]["result"]
    assert result["finishReason"] == "FINISH_REASON_LENGTH" and result["usage"]["completionTokens"] == 3
    assert result["timeline"][0]["state"] == "QUEUED" and result["instances"][0]["role"] == "INSTANCE_ROLE_PREFILL"


@pytest.mark.parametrize(
    ("argv", "exit_code", "message"),
    [
        (["generate", "hello", "--top-p", "2"], 3, "INVALID_ARGUMENT: sampling.top_p: must be in (0, 1]"),
        (["generate", "busy"], 7, "RESOURCE_EXHAUSTED: admission queue is full"),
        (["generate", "gone"], 5, "UNAVAILABLE: no healthy instance"),
        (["generate", "late"], 6, "DEADLINE_EXCEEDED: deadline passed"),
        (["generate", "final-error"], 9, "ABORTED: KV transfer failed 3 times"),
        (["generate", "hello", "--json", "--temperature", "-1"], 3, "sampling.temperature"),
    ],
)
def test_generate_errors_exit_per_class_with_one_line(server, capsys, argv, exit_code, message) -> None:
    code, _, err = _run(capsys, *argv, "--target", server.target)
    assert code == exit_code
    (line,) = err.strip().splitlines()
    assert line.startswith("duet generate: ") and message in line and "Traceback" not in err


def test_partial_text_is_ended_with_a_newline_before_an_error(server, capsys) -> None:
    code, out, _ = _run(capsys, "generate", "final-error", "--target", server.target)
    assert code == 9 and out == "Hi!\n"


def test_authentication_from_flag_or_environment(secured, capsys, monkeypatch) -> None:
    monkeypatch.delenv("DUET_TOKEN", raising=False)
    code, _, err = _run(capsys, "generate", "hello", "--target", secured.target)
    assert code == EXIT_CODES["UNAUTHENTICATED"] == 4 and "UNAUTHENTICATED" in err
    code, _, err = _run(capsys, "generate", "hello", "--target", secured.target, "--token", "wrong-token-000000000000")
    assert code == 4 and "UNAUTHENTICATED" in err and "not accepted" in err
    code, out, _ = _run(capsys, "generate", "hello", "--target", secured.target, "--token", TOKEN)
    assert code == 0 and out == "Hi!\n"
    monkeypatch.setenv("DUET_TOKEN", TOKEN)
    code, out, _ = _run(capsys, "status", "--target", secured.target)
    assert code == 0 and "queue depth: 3" in out


def test_connection_refused_is_one_clear_line(capsys) -> None:
    target = f"127.0.0.1:{free_port()}"
    for command in (["generate", "hello"], ["status"]):
        code, _, err = _run(capsys, *command, "--target", target)
        assert code == 5
        (line,) = err.strip().splitlines()
        assert f"cannot reach the duet front end at {target}" in line and "duet serve" in line


def test_status_table(server, capsys) -> None:
    code, out, _ = _run(capsys, "status", "--target", server.target)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["INSTANCE", "ROLE", "HEALTH", "KV", "BLOCKS", "FREE/TOTAL", "CACHED", "BLOCKS", "QUEUED", "RUNNING", "XFERS", "REPORTED", "ADDRESS"]
    assert lines[1].split() == ["p0", "PREFILL", "HEALTHY", "90/128", "7", "1", "2", "1", "1.5s", "ago", "127.0.0.1:7001"]
    assert lines[2].split()[:4] == ["g0", "GENERATION", "DRAINING", "10/256"]
    assert "queue depth: 3" in lines
    assert "requests by state: GENERATING=5, QUEUED=3" in lines
    assert "requests by outcome: COMPLETE=40, ERROR=2" in lines
    assert "placement: kv_aware" in lines
    assert "transfer recovery: retry_transfer -> recompute_local -> fail (at most 3 attempts)" in lines
    assert "model: built-in (LlamaForCausalLM, float32, context 2048 tokens, KV capacity 4096 tokens per instance)" in lines


def test_status_json(server, capsys) -> None:
    code, out, _ = _run(capsys, "status", "--json", "--target", server.target)
    assert code == 0
    status = json.loads(out)
    assert [i["instanceId"] for i in status["instances"]] == ["p0", "g0"]
    assert status["instances"][0]["load"]["freeBlocks"] == 90 and status["queueDepth"] == 3
    assert status["requestsByState"] == {"QUEUED": "3", "GENERATING": "5"}  # uint64 is a string in proto3 JSON


def test_status_watch_redraws_until_told_to_stop(server, capsys) -> None:
    code, out, _ = _run(capsys, "status", "--watch", "0.01", "--count", "3", "--target", server.target)
    assert code == 0 and out.count("queue depth: 3") == 3 and out.count(f"every 0.01s: {server.target}") == 3


def test_status_watch_keeps_going_while_the_front_end_is_down(capsys) -> None:
    target = f"127.0.0.1:{free_port()}"
    code, out, _ = _run(capsys, "status", "--watch", "0.01", "--count", "2", "--target", target)
    assert code == 0 and out.count("cannot reach the duet front end") == 2


def test_status_watch_stops_cleanly_on_ctrl_c(server, capsys, monkeypatch) -> None:
    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("cluster.cli.status.time.sleep", interrupt)
    code, out, _ = _run(capsys, "status", "--watch", "1", "--target", server.target)
    assert code == 130 and out.count("queue depth") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "hi", "--max-tokens", "-1"], "max_tokens"),
        (["generate", "hi", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read"),
        (["status", "--watch", "0"], "--watch"),
        (["status", "--watch", "1", "--count", "0"], "--count"),
    ],
)
def test_bad_command_lines_exit_2(capsys, argv, message) -> None:
    code, _, err = _run(capsys, *argv, "--target", f"127.0.0.1:{free_port()}")
    assert code == 2 and message in err and "Traceback" not in err


def test_no_command_prints_help(capsys) -> None:
    code, out, _ = _run(capsys)
    assert code == 0 and "generate" in out and "status" in out


def test_subcommands_are_pluggable() -> None:
    def add_demo(subparsers) -> None:
        subparsers.add_parser("demo").set_defaults(handler=lambda args: 0)

    parser = build_parser((add_demo,))
    assert parser.parse_args(["demo"]).handler(None) == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x"])


def test_render_status_without_instances() -> None:
    from cluster.client import ClusterStatus

    text = render_status(ClusterStatus((), 0, {}, {}, (), 0, "", 0.0))
    assert "no instances registered" in text and "requests by state: -" in text and "placement: -" in text


def _chat(messages, add_generation_prompt):
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
    return list(text.encode())


def test_generate_chat_sends_messages_rendered_by_the_server(capsys) -> None:
    with ServerThread(FakeRouter(SCRIPTS), chat=_chat) as chatty:
        code, _, _ = _run(capsys, "generate", "--message", "system=be brief", "--message", "user=hi", "--target", chatty.target)
        assert code == 0
        assert bytes(chatty.router.submitted[-1].prompt_token_ids) == b"<system>be brief<user>hi<assistant>"
        code, _, _ = _run(capsys, "generate", "--chat", '[{"role": "user", "content": "yo"}]', "--target", chatty.target)
        assert code == 0
        assert bytes(chatty.router.submitted[-1].prompt_token_ids) == b"<user>yo<assistant>"


def test_generate_chat_usage_errors_and_a_server_without_templates(server, capsys) -> None:
    code, _, err = _run(capsys, "generate", "--chat", "not json", "--target", server.target)
    assert code == EXIT_USAGE and "not JSON" in err
    code, _, err = _run(capsys, "generate", "--message", "user=hi", "--target", server.target)
    assert code == EXIT_CODES["INVALID_ARGUMENT"] and "messages: this server does not render chat templates" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_escapes_control_bytes_on_a_terminal(server, monkeypatch, capsys) -> None:
    terminal = _Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    code = main(["generate", "controls", "--target", server.target])
    assert code == 0 and terminal.getvalue() == "\\x1b[2Jok\\x07\n\tend\\x9b\n"
    monkeypatch.undo()
    code, out, _ = _run(capsys, "generate", "controls", "--target", server.target)
    assert code == 0 and out == "\x1b[2Jok\x07\n\tend\x9b\n"  # piped: as generated


@pytest.mark.parametrize(
    ("given", "target"),
    [
        ("localhost", "localhost:50051"),
        ("localhost:7000", "localhost:7000"),
        ("::1", "[::1]:50051"),
        ("[::1]", "[::1]:50051"),
        ("[::1]:7000", "[::1]:7000"),
        ("dns:///duet.example:443", "dns:///duet.example:443"),
        ("unix:/tmp/duet.sock", "unix:/tmp/duet.sock"),
    ],
)
def test_a_target_without_a_port_gets_duets(given, target) -> None:
    assert build_parser().parse_args(["status", "--target", given]).target == target


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_flag_has_help_and_every_command_a_log_level() -> None:
    for name, parser in _subparsers().items():
        flags = {option for action in parser._actions for option in action.option_strings}
        assert "--log-level" in flags, name
        for action in parser._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS:
                assert action.help, f"duet {name} {action.option_strings[0]} has no help text"
        text = parser.format_help()
        assert "(default: " in text or name == "demo", name


@pytest.mark.parametrize(
    ("command", "new", "old", "dest", "value", "parsed"),
    [
        ("chaos", "--num-requests", "--requests", "requests", "7", 7),
        ("chaos", "--out", None, "out", "results", "results"),
        ("chaos", "--json-out", None, "json_out", "x.json", "x.json"),
        ("generate", "--request-timeout", "--timeout", "timeout", "2.5", 2.5),
        ("serve", "--token", "--auth-token", "auth_token", "0123456789abcdef", ["0123456789abcdef"]),
    ],
)
def test_one_vocabulary_with_old_spellings_hidden(command, new, old, dest, value, parsed) -> None:
    extra = ["hi"] if command == "generate" else []
    for flag in filter(None, (new, old)):
        args = build_parser().parse_args([command, *extra, flag, value])
        assert getattr(args, dest) == parsed, flag
    if old is not None:
        text = _subparsers()[command].format_help()
        assert new in text and old not in text.replace(new, "")
