"""The real Codex CLI (`@openai/codex` from npm) against a live gateway, unchanged.

Codex is pointed at the gateway the way README.md tells users to: a `[model_providers.agentgate]`
entry with `wire_api = "responses"`, `model = "gpt-5-codex"` (an alias of the simulated pool).
It runs non-interactively (`codex exec`), fully offline (no update check, no analytics, no plugin
marketplace sync) with a read-only sandbox and `approval_policy = "never"`.

What is checked:
- a plain prompt: Codex exits 0 and prints the final message; the gateway logged one finished turn;
- a tool call: a prompt naming Codex's `exec_command` tool makes the simulated engine call it, Codex
  answers with a `function_call_output` and sends a second request; both turns finish;
- two turns of one thread (`codex exec resume <thread id>`): Codex resends the whole history
  (`store: false`) and the gateway serves the second turn.

Environment:
- `AGENTGATE_BIN`: the gateway binary (default `<repo>/target/debug/agentgate`);
- `AGENTGATE_CODEX_BIN`: the Codex launcher (default `<repo>/.tools/codex/node_modules/.bin/codex`,
  where scripts/test.sh installs it).

This module starts its own gateway; it does not use the fixtures of conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import bound_url

REPO_ROOT = Path(__file__).resolve().parents[2]
CODEX_VERSION = "0.171.0"
MODEL_ALIAS = "gpt-5-codex"
# Upper bounds so a hung process fails the test instead of the whole run; not speed assertions.
CODEX_TIMEOUT_S = 120
READY_TIMEOUT_S = 60
# The one tool-name mention that makes the simulated engine call a tool Codex declares
# (Codex 0.171 declares its shell tool as `exec_command`).
CODEX_SHELL_TOOL = "exec_command"
# Codex prints this as an error item for any model it has no built-in metadata for.
KNOWN_CODEX_WARNINGS = ("Model metadata for",)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


# --- the gateway ---------------------------------------------------------------------------------


def _gateway_config() -> str:
    """examples/quickstart.toml with instant simulated replicas (`time_scale = 0`), on port 0."""
    return f"""
[server]
listen = "127.0.0.1:0"

[tools]
hosted = "drop"

[[pools]]
name = "sim"
model = "sim-model"
aliases = ["{MODEL_ALIAS}", "gpt-4.1-mini"]
flavor = "vllm"
endpoints = []

[pools.simulate]
replicas = 2
block_size = 16
kv_blocks = 4096
max_num_seqs = 64
prefill_tokens_per_s = 20000
decode_ms_per_token = 20
time_scale = 0
"""


class Gateway:
    """One `agentgate serve` subprocess; its log (stderr) goes to a file the tests read."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.base_url = ""
        self.config_path = workdir / "gateway.toml"
        self.config_path.write_text(_gateway_config())
        self.log_path = workdir / "gateway.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", str(self.config_path)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            cwd=workdir, env=env,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"agentgate exited with {self.proc.returncode} before it was ready; "
                            f"its log:\n{self.log()}")
            if not self.base_url:
                self.base_url = bound_url(self.log()) or ""
                if not self.base_url:
                    last = "no 'agentgate listening on' line in its log yet"
                    time.sleep(0.05)
                    continue
            try:
                with urllib.request.urlopen(f"{self.base_url}/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except (urllib.error.URLError, OSError) as e:
                last = repr(e)
            time.sleep(0.1)
        pytest.fail(f"agentgate not ready after {READY_TIMEOUT_S}s ({last}); its log:\n{self.log()}")

    def log(self) -> str:
        return _ANSI.sub("", self.log_path.read_text(errors="replace"))

    def turns(self) -> list[dict[str, str]]:
        """The fields of every `turn finished` log line so far, oldest first."""
        found = []
        for line in self.log().splitlines():
            if "turn finished" in line:
                found.append({k: v.strip('"') for k, v in _FIELD.findall(line)})
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def gateway():
    binary = os.environ.get("AGENTGATE_BIN") or str(REPO_ROOT / "target" / "debug" / "agentgate")
    if not os.access(binary, os.X_OK):
        pytest.fail(f"agentgate binary {binary} is missing: run scripts/test.sh (or "
                    "`cargo build -p agentgate`), or point AGENTGATE_BIN at one")
    with tempfile.TemporaryDirectory(prefix="agentgate-codex-gw-") as d:
        gw = Gateway(binary, Path(d))
        try:
            yield gw
        finally:
            gw.stop()


# --- Codex ---------------------------------------------------------------------------------------


@dataclass
class CodexRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    last_message: str
    events: list[dict] = field(default_factory=list)

    def describe(self) -> str:
        return (f"argv: {self.argv}\nexit code: {self.returncode}\n"
                f"--- stdout ---\n{_tail(self.stdout)}\n--- stderr ---\n{_tail(self.stderr)}")


class Codex:
    """The Codex CLI with its own CODEX_HOME (config, sessions) and working directory."""

    def __init__(self, binary: str, version: str, gateway: Gateway, root: Path,
                 provider_name: str = "agentgate", extra_config: str = "",
                 builtin: bool = False) -> None:
        """`builtin`: Codex's own OpenAI provider with only its base URL changed (it tries a
        WebSocket first), instead of a `[model_providers.agentgate]` entry."""
        self.builtin = builtin
        self.binary = binary
        self.version = version
        self.gateway = gateway
        self.home = root / "codex-home"
        self.user_home = root / "home"
        self.workdir = root / "work"
        for d in (self.home, self.user_home, self.workdir):
            d.mkdir(parents=True, exist_ok=True)
        provider = (f'model_provider = "openai"\nopenai_base_url = "{gateway.base_url}/v1"'
                    if builtin else 'model_provider = "agentgate"')
        (self.home / "config.toml").write_text(f"""
model = "{MODEL_ALIAS}"
{provider}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
{extra_config}
[analytics]
enabled = false

[features]
# No plugin marketplace sync (a `git clone` from github.com) and no login-shell snapshot.
plugins = false
shell_snapshot = false

[model_providers.agentgate]
name = "{provider_name}"
base_url = "{gateway.base_url}/v1"
wire_api = "responses"
env_key = "AGENTGATE_API_KEY"
# Failures must surface, not be retried away.
request_max_retries = 0
stream_max_retries = 0
""")

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OPENAI_", "CODEX_", "RUST_LOG"))}
        env.update(CODEX_HOME=str(self.home), HOME=str(self.user_home),
                   AGENTGATE_API_KEY="unused-when-open", NO_COLOR="1")
        if self.builtin:
            env["OPENAI_API_KEY"] = "unused-when-open"
        return env

    def exec(self, *args: str, json_events: bool = True) -> CodexRun:
        """`codex exec [--json] ... ARGS` with stdin closed; ARGS is a prompt or `resume ID PROMPT`."""
        last_path = self.workdir.parent / f"last-message-{time.monotonic_ns()}.txt"
        argv = [self.binary, "exec", "--strict-config", "--skip-git-repo-check",
                "--output-last-message", str(last_path)]
        if json_events:
            argv.append("--json")
        argv += list(args)
        try:
            proc = subprocess.run(argv, cwd=self.workdir, env=self.env(), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=CODEX_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"codex did not finish within {CODEX_TIMEOUT_S}s\nargv: {argv}\n"
                        f"--- stdout ---\n{_tail(e.stdout or '')}\n"
                        f"--- stderr ---\n{_tail(e.stderr or '')}\n"
                        f"--- gateway log ---\n{_tail(self.gateway.log())}")
        last = last_path.read_text() if last_path.exists() else ""
        run = CodexRun(argv, proc.returncode, proc.stdout, proc.stderr, last.strip())
        if json_events:
            for line in proc.stdout.splitlines():
                line = line.strip()
                if line.startswith("{"):
                    run.events.append(json.loads(line))
        return run

    def rollout(self, thread_id: str) -> list[dict]:
        """The items Codex recorded for a thread (its session file), as `response_item` payloads."""
        files = sorted(self.home.glob(f"sessions/**/*{thread_id}.jsonl"))
        assert files, f"no session file for thread {thread_id} under {self.home / 'sessions'}"
        items = []
        for line in files[-1].read_text().splitlines():
            record = json.loads(line)
            if record.get("type") == "response_item":
                items.append(record["payload"])
        return items


@pytest.fixture(scope="module")
def codex_bin() -> tuple[str, str]:
    binary = os.environ.get("AGENTGATE_CODEX_BIN") or str(
        REPO_ROOT / ".tools" / "codex" / "node_modules" / ".bin" / "codex")
    if not os.access(binary, os.X_OK):
        pytest.fail(f"Codex CLI not found at {binary}: run scripts/test.sh, which installs "
                    f"@openai/codex@{CODEX_VERSION} into .tools/codex (or set AGENTGATE_CODEX_BIN)")
    out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
    assert out.returncode == 0, f"`{binary} --version` failed:\n{out.stderr}"
    return binary, out.stdout.strip()


@pytest.fixture
def codex(codex_bin, gateway, tmp_path) -> Codex:
    binary, version = codex_bin
    return Codex(binary, version, gateway, tmp_path)


# --- checks --------------------------------------------------------------------------------------


def _context(codex: Codex, run: CodexRun) -> str:
    return (f"{codex.version}\n{run.describe()}\n--- gateway log ---\n"
            f"{_tail(codex.gateway.log())}")


def assert_clean_json_run(codex: Codex, run: CodexRun) -> str:
    """Exit 0, one completed turn, no failures; returns the final agent message."""
    ctx = _context(codex, run)
    assert run.returncode == 0, ctx
    types = [e.get("type") for e in run.events]
    assert types and types[0] == "thread.started", ctx
    assert "turn.failed" not in types and "error" not in types, ctx
    assert types.count("turn.completed") == 1, ctx
    errors = [e["item"].get("message", "") for e in run.events
              if e.get("type") == "item.completed" and e["item"].get("type") == "error"]
    unexpected = [m for m in errors if not m.startswith(KNOWN_CODEX_WARNINGS)]
    assert not unexpected, f"Codex reported errors: {unexpected}\n{ctx}"
    messages = [e["item"]["text"] for e in run.events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages, f"no agent_message in Codex's events\n{ctx}"
    assert messages[-1].strip(), ctx
    assert run.last_message == messages[-1].strip(), ctx
    return messages[-1].strip()


def assert_new_turns(codex: Codex, before: int, count: int, run: CodexRun) -> list[dict]:
    turns = codex.gateway.turns()
    new = turns[before:]
    ctx = _context(codex, run)
    assert len(new) == count, f"expected {count} new finished turn(s) on the gateway, got {new}\n{ctx}"
    for turn in new:
        assert turn.get("status") == "completed", f"{turn}\n{ctx}"
        assert turn.get("response", "").startswith("resp_"), f"{turn}\n{ctx}"
        assert turn.get("endpoint", "").startswith("sim/"), f"{turn}\n{ctx}"
    return new


def _message_text(item: dict) -> str:
    return "".join(part.get("text", "") for part in item.get("content") or [])


# --- tests ---------------------------------------------------------------------------------------


def test_codex_exec_plain_prompt(codex):
    """`codex exec "..."` in its default (human) output mode prints the gateway's answer."""
    before = len(codex.gateway.turns())
    run = codex.exec("Say hello in one short sentence.", json_events=False)
    ctx = _context(codex, run)
    assert run.returncode == 0, ctx
    assert run.last_message, f"Codex wrote no final message\n{ctx}"
    assert run.last_message in run.stdout, ctx
    # The simulated engine's filler: capitalised words ending with a full stop.
    assert re.fullmatch(r"[A-Z]\w*( \w+)*\.", run.last_message), ctx
    assert_new_turns(codex, before, 1, run)


def test_codex_exec_tool_call_round_trip(codex):
    """A prompt naming Codex's shell tool: the engine calls it, Codex answers the call with a
    `function_call_output` in a second request, and the second turn ends with a message."""
    before = len(codex.gateway.turns())
    run = codex.exec(f"List the files here with the {CODEX_SHELL_TOOL} tool.")
    final = assert_clean_json_run(codex, run)
    assert_new_turns(codex, before, 2, run)

    thread_id = run.events[0]["thread_id"]
    items = codex.rollout(thread_id)
    ctx = f"{_context(codex, run)}\n--- session items ---\n" + "\n".join(
        json.dumps(i)[:300] for i in items)
    calls = [i for i in items if i.get("type") == "function_call"]
    assert [c.get("name") for c in calls] == [CODEX_SHELL_TOOL], ctx
    call = calls[0]
    json.loads(call["arguments"])  # complete JSON arguments, assembled from the streamed deltas
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    assert [o.get("call_id") for o in outputs] == [call["call_id"]], ctx
    kinds = [i.get("type") for i in items]
    assert kinds.index("function_call") < kinds.index("function_call_output"), ctx
    assistant = [i for i in items if i.get("type") == "message" and i.get("role") == "assistant"]
    assert assistant and _message_text(assistant[-1]).strip() == final, ctx


def test_codex_exec_resume_second_turn(codex):
    """Two turns of one thread: `codex exec` then `codex exec resume <thread id>`."""
    before = len(codex.gateway.turns())
    first = codex.exec("Name three prime numbers.")
    first_text = assert_clean_json_run(codex, first)
    assert_new_turns(codex, before, 1, first)
    thread_id = first.events[0]["thread_id"]

    second = codex.exec("resume", thread_id, "And what is their sum?")
    second_text = assert_clean_json_run(codex, second)
    assert second.events[0]["thread_id"] == thread_id, _context(codex, second)
    assert_new_turns(codex, before + 1, 1, second)

    # Codex's record of the thread: both exchanges, in order, each answered by the gateway.
    items = codex.rollout(thread_id)
    convo = [(i["role"], _message_text(i).strip()) for i in items
             if i.get("type") == "message" and i.get("role") in ("user", "assistant")]
    ctx = f"{_context(codex, second)}\n--- thread messages ---\n" + "\n".join(
        f"{r}: {t[:200]}" for r, t in convo)
    prompts = [t for r, t in convo if r == "user" and not t.startswith("<")]
    assert prompts == ["Name three prime numbers.", "And what is their sum?"], ctx
    answers = [t for r, t in convo if r == "assistant"]
    assert answers == [first_text, second_text], ctx


def test_codex_builtin_provider_falls_back_to_http_at_once(codex_bin, gateway, tmp_path):
    """Codex's built-in provider with only its base URL changed (README.md allows it) opens a
    WebSocket to `/v1/responses` first. The gateway answers the upgrade 426, on which Codex goes
    over HTTP at once; a 405 had it retry five times, reporting each as an error event."""
    binary, version = codex_bin
    codex = Codex(binary, version, gateway, tmp_path, builtin=True)
    before = len(gateway.turns())
    run = codex.exec("Name three prime numbers.")
    assert_clean_json_run(codex, run)
    assert_new_turns(codex, before, 1, run)


def test_codex_remote_compaction_round_trip(codex_bin, gateway, tmp_path):
    """Codex compacting its context through the gateway, then carrying on.

    Codex compacts remotely (a `/v1/responses` turn whose input ends with a
    `compaction_trigger`, answered by exactly one `compaction` item) when its provider is named
    "OpenAI", as the built-in provider is when users only change its base URL. A tiny
    `model_auto_compact_token_limit` makes the second turn compact first; that turn then sends
    the compaction item back, which the gateway must read."""
    binary, version = codex_bin
    codex = Codex(binary, version, gateway, tmp_path, provider_name="OpenAI",
                  extra_config="model_auto_compact_token_limit = 200\n")
    before = len(gateway.turns())
    first = codex.exec("Name three prime numbers.")
    assert_clean_json_run(codex, first)
    thread_id = first.events[0]["thread_id"]
    after_first = len(gateway.turns())

    second = codex.exec("resume", thread_id, "And what is their sum?")
    assert_clean_json_run(codex, second)
    new = gateway.turns()[after_first:]
    ctx = f"{_context(codex, second)}\nturns: {new}"
    assert [t.get("compaction") for t in new] == ["true", "false"], ctx
    assert all(t.get("status") == "completed" for t in new), ctx
    assert after_first > before, f"the first run sent no turn\n{ctx}"
    assert all(t.get("compaction") == "false" for t in gateway.turns()[before:after_first]), ctx

    # Codex replaced the thread's history with its user messages and the gateway's item.
    files = sorted(codex.home.glob(f"sessions/**/*{thread_id}.jsonl"))
    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    compacted = [r["payload"] for r in records if r.get("type") == "compacted"]
    assert compacted, f"no compacted record in Codex's session\n{ctx}"
    replacement = compacted[-1].get("replacement_history") or []
    kinds = [i.get("type") for i in replacement]
    assert kinds.count("compaction") == 1, f"{kinds}\n{ctx}"
    item = next(i for i in replacement if i.get("type") == "compaction")
    assert item["encrypted_content"], ctx
