"""Requests shaped like the ones Codex CLI sends, over raw HTTP.

Codex runs stateless: `store: false`, the full history every turn (messages, function calls and
their outputs, reasoning items carrying `encrypted_content` from earlier responses),
`prompt_cache_key` = the thread id, a `session-id` header, `include:
["reasoning.encrypted_content"]`, MCP tools grouped as `namespace` tools, and hosted tools such as
`web_search` that the gateway drops.
"""

from __future__ import annotations

import json
import uuid

import httpx2 as httpx

from conftest import ALIAS

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}

DOCS_NAMESPACE = {
    "type": "namespace",
    "name": "mcp__docs",
    "description": "Documentation server",
    "tools": [{
        "type": "function",
        "name": "search",
        "description": "Search the docs.",
        "strict": False,
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"], "additionalProperties": False},
    }],
}

TOOLS = [SHELL_TOOL, DOCS_NAMESPACE, {"type": "web_search"}]


def read_sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) pairs of a text/event-stream body; checks the framing as it goes."""
    events, name, data = [], None, []
    for line in response.iter_lines():
        if line == "":
            if data:
                events.append((name, json.loads("\n".join(data))))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].strip())
        elif line.startswith(":"):
            continue
        else:
            raise AssertionError(f"unexpected SSE line {line!r}")
    assert not data, "the stream ended in the middle of an event"
    return events


def assert_well_formed(events: list[tuple[str, dict]]) -> dict:
    """Checks event names, sequence numbers and item bracketing; returns the final response."""
    assert events, "empty stream"
    for name, data in events:
        assert name == data["type"], f"event name {name} != data.type {data['type']}"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed", names[-1]
    assert sum(n in ("response.completed", "response.failed", "response.incomplete")
               for n in names) == 1
    open_items = {}
    for name, data in events:
        if name == "response.output_item.added":
            assert data["output_index"] not in open_items
            open_items[data["output_index"]] = data["item"]["id"]
        elif name == "response.output_item.done":
            assert open_items.pop(data["output_index"]) == data["item"]["id"]
    assert not open_items, f"items never closed: {open_items}"
    final = events[-1][1]["response"]
    done_items = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert [i["id"] for i in final["output"]] == [i["id"] for i in done_items]
    return final


def codex_body(history: list[dict], thread_id: str, **overrides) -> dict:
    body = {
        "model": ALIAS,
        "instructions": "You are a coding agent working in a repository.",
        "input": history,
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": thread_id,
    }
    body.update(overrides)
    return body


def headers(thread_id: str) -> dict:
    return {"authorization": "Bearer codex-key", "session-id": thread_id,
            "originator": "codex_cli_rs", "accept": "text/event-stream"}


def post_stream(gateway, body: dict, thread_id: str) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{gateway.base_url}/v1/responses", json=body,
                      headers=headers(thread_id), timeout=60.0) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"{r.status_code}: {r.text}")
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_sse(r)


def reasoning_item_of(final: dict) -> dict:
    """The earlier response's reasoning item (requested with `reasoning.effort`), as a client
    replays it; it must carry `encrypted_content`, since the request listed
    `reasoning.encrypted_content` in `include`."""
    produced = [i for i in final["output"] if i["type"] == "reasoning"]
    assert produced, f"a reasoning request produced no reasoning item: {final['output']}"
    item = produced[0]
    assert isinstance(item.get("encrypted_content"), str) and item["encrypted_content"], \
        f"include=reasoning.encrypted_content but the reasoning item has none: {item}"
    # Replay it the way a stateless client does: the opaque blob only, no readable content.
    return {"type": "reasoning", "id": item["id"], "summary": item["summary"],
            "encrypted_content": item["encrypted_content"]}


def test_codex_style_turns(gateway):
    thread_id = str(uuid.uuid4())
    user = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "List the files in this repo."}]}
    first = assert_well_formed(post_stream(gateway, codex_body([user], thread_id), thread_id))
    assert first["store"] is False
    assert first["prompt_cache_key"] == thread_id

    reasoning = reasoning_item_of(first)
    assistant_items = [i for i in first["output"] if i["type"] == "message"]
    call_id = f"call_{uuid.uuid4().hex[:12]}"
    history = [
        user,
        reasoning,
        *assistant_items,
        {"type": "function_call", "call_id": call_id, "name": "shell",
         "arguments": json.dumps({"command": ["ls", "-la"], "workdir": "/repo"})},
        {"type": "function_call_output", "call_id": call_id,
         "output": "README.md\nCargo.toml\nsrc\n"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Now summarise what you found."}]},
    ]
    events = post_stream(gateway, codex_body(history, thread_id), thread_id)
    second = assert_well_formed(events)
    assert second["status"] == "completed"
    assert second["store"] is False
    assert not [i for i in second["output"] if i["type"] == "function_call"], \
        "the model answers in text after a tool result"
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text.strip()
    # The hosted tool is dropped for the engine but the response echoes the request's tools.
    assert [t["type"] for t in second["tools"]] == ["function", "namespace", "web_search"]

    # The replayed reasoning reaches the engine: the same history without it is shorter.
    without = [i for i in history if i["type"] != "reasoning"]
    shorter = assert_well_formed(post_stream(gateway, codex_body(without, thread_id), thread_id))
    assert second["usage"]["input_tokens"] > shorter["usage"]["input_tokens"]

    # Nothing was stored.
    r = httpx.get(f"{gateway.base_url}/v1/responses/{second['id']}", headers=headers(thread_id))
    assert r.status_code == 404


def test_namespace_tool_call_round_trip(gateway):
    thread_id = str(uuid.uuid4())
    user = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Find the docs on routing."}]}
    body = codex_body([user], thread_id, stream=False,
                      tool_choice={"type": "function", "name": "search", "namespace": "mcp__docs"})
    r = httpx.post(f"{gateway.base_url}/v1/responses", json=body, headers=headers(thread_id),
                   timeout=60.0)
    assert r.status_code == 200, r.text
    calls = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert len(calls) >= 1
    call = calls[0]
    assert call["name"] == "search"
    assert call["namespace"] == "mcp__docs"
    assert isinstance(json.loads(call["arguments"])["query"], str)

    history = [user, call, {"type": "function_call_output", "call_id": call["call_id"],
                            "output": "routing.md: sessions stick to the replica with their cache"}]
    events = post_stream(gateway, codex_body(history, thread_id), thread_id)
    final = assert_well_formed(events)
    assert final["status"] == "completed"
    assert any(i["type"] == "message" for i in final["output"])


def test_hosted_tool_only_request_still_answers(gateway):
    thread_id = str(uuid.uuid4())
    user = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Search the web for Rust news."}]}
    body = codex_body([user], thread_id, tools=[{"type": "web_search"}])
    final = assert_well_formed(post_stream(gateway, body, thread_id))
    assert final["status"] == "completed"
    assert not [i for i in final["output"] if i["type"] == "function_call"]
