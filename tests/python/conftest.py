"""Gateway processes for the SDK conformance tests.

Each fixture writes a configuration file, starts `agentgate serve` as a subprocess listening on
port 0 of the loopback address (its log goes to a temporary file; the port the kernel bound is
read from the gateway's `listening on` log line, so no other process can take it between a
probe and the bind), waits for `GET /health/ready` and hands out
`openai.OpenAI` clients pointed at it. The process is stopped when the test session ends.

Environment:
- `AGENTGATE_BIN`: the `agentgate` binary to run; when unset it is built with
  `cargo build -p agentgate` and `target/debug/agentgate` is used.
- `AGENTGATE_TEST_REDIS_URL`: when set, the gateways that keep conversation state use this Redis
  (each with its own key prefix); otherwise they use the in-memory store.
- `RUST_LOG` is set to `info` for the gateways, whatever it is here: the harness needs their
  `listening on` line.

When a test fails, the tail of every running gateway's log is attached to the failure report.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
ALIAS = "gpt-5-codex"
# An alias with a slash, as Hugging Face model names have.
SLASHED_ALIAS = "org/sim-model"
TEAM_A_KEY = "sk-test-team-alpha"
TEAM_B_KEY = "sk-test-team-beta"
READY_TIMEOUT_S = 60.0

_RUNNING: list["GatewayProcess"] = []

# The line `agentgate serve` logs once its listener is bound (gateway/src/main.rs).
LISTENING = re.compile(r"agentgate listening on (http://[0-9.]+:[0-9]+)\s")


def bound_url(log_text: str) -> str | None:
    """The base URL a gateway logged once it was listening, if it has yet (a line still being
    written does not count: the port must be followed by whitespace)."""
    found = LISTENING.search(log_text)
    return found.group(1) if found else None


def _agentgate_bin() -> str:
    configured = os.environ.get("AGENTGATE_BIN")
    if configured:
        if not os.access(configured, os.X_OK):
            pytest.exit(f"AGENTGATE_BIN={configured} is not an executable file; build it with "
                        "`cargo build -p agentgate` or unset AGENTGATE_BIN", returncode=2)
        return configured
    result = subprocess.run(["cargo", "build", "-p", "agentgate"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.exit("`cargo build -p agentgate` failed:\n" + result.stderr[-4000:], returncode=2)
    return str(REPO_ROOT / "target" / "debug" / "agentgate")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hash_key(binary: str, key: str) -> str:
    """The digest `agentgate hash-key KEY` prints (what `[[teams]] api_key_sha256` holds)."""
    out = subprocess.run([binary, "hash-key", key], capture_output=True, text=True, check=True)
    digest = out.stdout.strip()
    assert len(digest) == 64, f"hash-key printed {digest!r}"
    return digest


def config_toml(*, time_scale: float, replicas: int, decode_ms_per_token: float = 20,
                store_url: str | None = None, teams: dict[str, str] | None = None,
                key_prefix: str | None = None, extra: str = "") -> str:
    """A gateway configuration shaped like examples/quickstart.toml.

    `key_prefix` names the deployment in the store (a fresh one when unset; gateways that share
    a store and a prefix share conversation state and rate-limit budgets); `extra` is appended
    as is (more `[[teams]]`, `[flow]`, ...).
    """
    key_prefix = key_prefix or f"agentgate-pytest-{uuid.uuid4().hex[:12]}:"
    lines = [
        "[server]",
        'listen = "127.0.0.1:0"',
        "",
        "[store]",
    ]
    if store_url:
        lines.append(f"url = {json.dumps(store_url)}")
    lines += [
        f"key_prefix = {json.dumps(key_prefix)}",
        "",
        "[tools]",
        'hosted = "drop"',
        "",
        "[[pools]]",
        'name = "sim"',
        f'model = "{MODEL}"',
        f'aliases = ["{ALIAS}", "{SLASHED_ALIAS}"]',
        'flavor = "vllm"',
        "endpoints = []",
        "",
        "[pools.simulate]",
        f"replicas = {replicas}",
        f"decode_ms_per_token = {float(decode_ms_per_token)!r}",
        f"time_scale = {float(time_scale)!r}",
        "",
    ]
    for name, digest in (teams or {}).items():
        lines += ["[[teams]]", f'name = "{name}"', f'api_key_sha256 = ["{digest}"]', ""]
    return "\n".join(lines) + extra


class GatewayProcess:
    """One `agentgate serve` subprocess with its config file and log file."""

    def __init__(self, binary: str, name: str, config: str, workdir: Path) -> None:
        self.name = name
        self.config_path = workdir / f"{name}.toml"
        self.config_path.write_text(config)
        self.log_path = workdir / f"{name}.log"
        self.base_url = ""
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", str(self.config_path), "--listen", "127.0.0.1:0"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir,
            env={**os.environ, "NO_COLOR": "1", "RUST_LOG": "info"},
        )
        _RUNNING.append(self)
        try:
            self._wait_ready()
        except Exception:
            self.stop()
            raise

    def log_tail(self, limit: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gateway '{self.name}' exited with {self.proc.returncode} before it "
                            f"was ready; its log:\n{self.log_tail()}")
            if not self.base_url:
                self.base_url = bound_url(self.log_tail(limit=1 << 20)) or ""
                if not self.base_url:
                    last = "no 'agentgate listening on' line in its log yet"
                    time.sleep(0.05)
                    continue
            try:
                r = httpx.get(f"{self.base_url}/health/ready", timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.1)
        pytest.fail(f"gateway '{self.name}' not ready after {READY_TIMEOUT_S}s ({last}); "
                    f"its log:\n{self.log_tail()}")

    def client(self, api_key: str = "unused-when-open") -> openai.OpenAI:
        """An SDK client for this gateway that never retries (failures stay visible)."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                             timeout=60.0)

    def stop(self) -> None:
        _stop(self.proc)
        self._log.close()
        if self in _RUNNING:
            _RUNNING.remove(self)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for gw in list(_RUNNING):
            report.sections.append((f"agentgate log ({gw.name})", gw.log_tail()))


@pytest.fixture(scope="session")
def agentgate_bin() -> str:
    return _agentgate_bin()


@pytest.fixture(scope="session")
def workdir():
    with tempfile.TemporaryDirectory(prefix="agentgate-pytest-") as d:
        yield Path(d)


def _start(binary: str, name: str, config: str, workdir: Path):
    gw = GatewayProcess(binary, name, config, workdir)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="session")
def redis_url(workdir):
    """A real Redis: `AGENTGATE_TEST_REDIS_URL` (what scripts/test.sh starts), or else a
    `redis-server` started here on a free loopback port for this test session."""
    configured = os.environ.get("AGENTGATE_TEST_REDIS_URL")
    if configured:
        yield configured
        return
    # redis-server cannot report a port the kernel picked, so probe for a free one; should
    # another process take it before redis-server binds, redis-server exits and the next
    # attempt probes again.
    last = "no attempt"
    for _attempt in range(5):
        port = _free_port()
        try:
            proc = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                 "--appendonly", "no", "--dir", str(workdir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            pytest.fail("redis-server is not installed; scripts/test.sh installs and starts it")
        if _redis_answers(proc, port) and proc.poll() is None:
            break  # answered, and by this process (not one that held the port already)
        last = f"redis-server on port {port} exited with {proc.poll()} or did not answer PING"
        _stop(proc)
    else:
        pytest.fail(f"could not start redis-server: {last}")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)


def _redis_answers(proc: subprocess.Popen, port: int) -> bool:
    """Wait up to 10 s for the redis-server `proc` to answer PING on `port`; false if it exits."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen) -> None:
    """Terminate `proc` (a gateway or redis-server), killing it if it has not exited in 10 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def gateway(agentgate_bin, workdir):
    """An open gateway (no keys) with two instant simulated replicas."""
    config = config_toml(time_scale=0, replicas=2,
                         store_url=os.environ.get("AGENTGATE_TEST_REDIS_URL"))
    yield from _start(agentgate_bin, "open", config, workdir)


@pytest.fixture(scope="session")
def client(gateway) -> openai.OpenAI:
    return gateway.client()


@pytest.fixture(scope="session")
def auth_gateway(agentgate_bin, workdir):
    """A gateway with two teams, `alpha` and `beta`, each with its own API key."""
    teams = {"alpha": hash_key(agentgate_bin, TEAM_A_KEY),
             "beta": hash_key(agentgate_bin, TEAM_B_KEY)}
    config = config_toml(time_scale=0, replicas=2, teams=teams,
                         store_url=os.environ.get("AGENTGATE_TEST_REDIS_URL"))
    yield from _start(agentgate_bin, "teams", config, workdir)


@pytest.fixture(scope="session")
def slow_gateway(agentgate_bin, workdir):
    """An open gateway whose replica decodes in real time (for cancelling running work)."""
    config = config_toml(time_scale=1.0, replicas=1, decode_ms_per_token=200)
    yield from _start(agentgate_bin, "slow", config, workdir)
