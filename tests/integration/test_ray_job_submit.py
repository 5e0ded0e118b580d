"""The `ray job submit` path: a head this test starts itself (own process group, temp dir and free
ports on 127.0.0.1), `ray job submit --working-dir . -- duet serve ...` with
RAY_JOB_STOP_WAIT_TIME_S in the job's runtime environment (as the README says), a client request
through the front end, then `ray job stop` while a request that runs longer than Ray's default 3 s
stop wait is in flight: it completes (graceful drain), then the head is stopped by killing its
process group (never a global `ray stop`)."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cluster.client import DuetClient, DuetError

REPO = Path(__file__).resolve().parents[2]
HOLD_S = 6.0
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _head_port(taken: set[int]) -> int:
    """A free port between Ray's worker ports (10002-19999) and the kernel's ephemeral range (from
    32768), where the head's own processes pick theirs: a port from bind(0) could be taken by one of
    them before the dashboard binds it (seen once in CI: the dashboard's port already in use)."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, 32000)
        if port in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # `ray start` and `ray job submit` must agree on the auth mode.
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # stay on 127.0.0.1 (tests/conftest.py)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def _ray(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(BIN / "ray"), *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
    )
    if check and result.returncode != 0:
        raise AssertionError(f"ray {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}")
    return result


@pytest.fixture
def head():
    temp_dir = tempfile.mkdtemp(prefix="duetray", dir="/tmp")
    taken: set[int] = set()
    gcs_port, dashboard_port, agent_port = _head_port(taken), _head_port(taken), _head_port(taken)
    process = subprocess.Popen(
        [
            str(BIN / "ray"), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
            # The job agent's HTTP port is fixed (52365) unless given: another Ray on this machine
            # holding it leaves the head without a job agent ("No available agent").
            f"--dashboard-agent-listen-port={agent_port}",
            "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats",
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, which the teardown kills
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"ray start exited with {process.returncode}")
            if _ray("job", "list", "--address", address, timeout_s=30, check=False).returncode == 0:
                break
            time.sleep(1)
        else:
            raise AssertionError("the head's job API never came up")
        yield address
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue


def test_ray_job_submit_serves_and_drains(head, tmp_path) -> None:
    port = _free_port()
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "dtype: float32\n"
        "device: cpu\n"
        "instances:\n"
        "  - {role: PREFILL, count: 1, num_cpus: 0.5}\n"
        "  - {role: GENERATION, count: 1, num_cpus: 0.5}\n"
        "engine: {num_blocks: 256}\n"
        f"frontend: {{host: 127.0.0.1, port: {port}, metrics_port: 0, http_port: 0}}\n"
        "drain_timeout_s: 20\n"
        # The in-flight request of the stop: held mid-generation for longer than Ray's default
        # 3 s between SIGTERM and SIGKILL.
        f"faults: {{rules: [{{kind: hold, state: GENERATION_IN_PROGRESS, seconds: {HOLD_S}, request_ids: ['slow*.g1']}}]}}\n"
    )
    runtime_env = '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "40"}}'
    deadline = time.monotonic() + 90
    while True:  # the job agent may come up a little after the job API answers
        submitted = _ray(
            "job", "submit", "--address", head, "--no-wait", "--working-dir", str(REPO),
            "--runtime-env-json", runtime_env,
            "--", "duet", "serve", "--config", str(config),
            check=False,
        )
        if submitted.returncode == 0 or "No available agent" not in submitted.stdout or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert submitted.returncode == 0, submitted.stdout[-3000:]
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout).group(0)
    try:
        target = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            logs = _ray("job", "logs", "--address", head, job_id, check=False).stdout
            if f"serving on {target}" in logs:
                break
            status = _ray("job", "status", "--address", head, job_id, check=False).stdout
            if "FAILED" in status or time.monotonic() > deadline:
                raise AssertionError(f"duet serve did not come up:\n{status}\n{logs[-4000:]}")
            time.sleep(1)
        with DuetClient(target, timeout_s=60) as client:
            done = client.complete([256, 72, 105], max_tokens=6, temperature=0.0, ignore_eos=True)
            assert len(done.token_ids) == 6
            assert [w.phase for w in done.instances] == ["prefill", "generation"]

            slow: dict[str, object] = {}

            def run_slow() -> None:
                try:
                    slow["result"] = client.complete(
                        [256, 72, 105], max_tokens=6, temperature=0.0, ignore_eos=True, client_request_id="slow-1"
                    )
                except DuetError as error:  # pragma: no cover - reported by the assertion below
                    slow["error"] = error
                slow["ended_s"] = time.monotonic()

            thread = threading.Thread(target=run_slow, daemon=True)
            thread.start()
            deadline = time.monotonic() + 30
            while not client.cluster_status().requests_by_state.get("GENERATING"):
                assert time.monotonic() < deadline, "the slow request never reached GENERATING"
                time.sleep(0.1)
            stop_s = time.monotonic()
            stopped = _ray("job", "stop", "--address", head, job_id, check=False, timeout_s=120)
            thread.join(timeout=60)
        assert "result" in slow, f"the in-flight request did not complete: {slow.get('error')}\n{stopped.stdout[-2000:]}"
        assert len(slow["result"].token_ids) == 6
        # It outlived Ray's default stop wait: only the runtime environment's longer one let it finish.
        assert slow["ended_s"] - stop_s > 3.0
    finally:
        _ray("job", "stop", "--address", head, job_id, check=False, timeout_s=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = _ray("job", "status", "--address", head, job_id, check=False).stdout.lower()
        if "stopped" in status or "succeeded" in status:
            break
        time.sleep(1)
    assert "stopped" in status or "succeeded" in status, status
    logs = _ray("job", "logs", "--address", head, job_id, check=False).stdout
    assert "draining in-flight requests" in logs, logs[-3000:]  # SIGTERM drained it
    with DuetClient(target, timeout_s=5) as client, pytest.raises(DuetError):
        client.health()  # the front end is gone
