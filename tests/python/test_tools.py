"""Function calling and structured output through the official `openai` SDK."""

from __future__ import annotations

import json

import pydantic

from conftest import MODEL

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather and forecast for a city.",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}

TIME_TOOL = dict(WEATHER_TOOL, name="get_time", description="Current time in a city.",
                 parameters={"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"], "additionalProperties": False})

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "coastal": {"type": "boolean"},
        "districts": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "country", "population", "coastal", "districts"],
    "additionalProperties": False,
}

_JSON_TYPES = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
}


def assert_matches_schema(value, schema, path="$"):
    """A small JSON Schema check: type, required, properties, additionalProperties, enum,
    items, minimum/maximum — the subset these tests use."""
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not an integer"
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: not a number"
    elif kind is not None:
        assert isinstance(value, _JSON_TYPES[kind]), f"{path}: {value!r} is not of type {kind}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "minimum" in schema:
        assert value >= schema["minimum"], f"{path}: {value!r} < {schema['minimum']}"
    if "maximum" in schema:
        assert value <= schema["maximum"], f"{path}: {value!r} > {schema['maximum']}"
    if kind == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: required key {key!r} missing from {value!r}"
        if schema.get("additionalProperties") is False:
            extra = set(value) - set(props)
            assert not extra, f"{path}: unexpected keys {extra}"
        for key, sub in props.items():
            if key in value:
                assert_matches_schema(value[key], sub, f"{path}.{key}")
    if kind == "array" and "items" in schema:
        for i, element in enumerate(value):
            assert_matches_schema(element, schema["items"], f"{path}[{i}]")


def _function_calls(response):
    return [item for item in response.output if item.type == "function_call"]


def _require_weather_call(client, **extra):
    r = client.responses.create(
        model=MODEL,
        input="What's the weather in Paris for the next days?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        **extra,
    )
    assert r.status == "completed"
    calls = _function_calls(r)
    assert len(calls) >= 1, f"tool_choice=required must produce a function_call, got {r.output}"
    call = calls[0]
    assert call.name == "get_weather"
    assert call.call_id
    assert call.id and call.id.startswith("fc_")
    assert call.status == "completed"
    arguments = json.loads(call.arguments)
    assert_matches_schema(arguments, WEATHER_SCHEMA)
    return r, call


def test_required_tool_choice_yields_schema_valid_call(client):
    r, _ = _require_weather_call(client)
    assert r.tools[0].name == "get_weather"
    assert r.tool_choice == "required"


def test_function_call_output_chained_via_previous_response_id(client):
    first, call = _require_weather_call(client)
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature": 21, "sky": "clear"})}],
        tools=[WEATHER_TOOL],
    )
    assert second.status == "completed"
    assert not _function_calls(second), "after a tool result the model answers in text"
    assert second.output_text.strip()
    # The stored conversation now holds the call and its output.
    items = list(client.responses.input_items.list(second.id, order="asc", limit=100))
    kinds = [item.type for item in items]
    assert kinds == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == call.call_id and items[2].call_id == call.call_id


def test_function_call_output_stateless_with_full_history(client):
    user = {"role": "user", "content": "What's the weather in Paris for the next days?"}
    first, call = _require_weather_call(client, store=False)
    second = client.responses.create(
        model=MODEL,
        store=False,
        input=[
            user,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id,
             "output": json.dumps({"temperature": 21})},
        ],
        tools=[WEATHER_TOOL],
    )
    assert second.status == "completed"
    assert not _function_calls(second)
    assert second.output_text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens


def test_streamed_function_call_arguments_concatenate(client):
    stream = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER_TOOL], tool_choice="required",
        stream=True,
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call"
    item_id = added[0].item.id
    deltas = [e.delta for e in events
              if e.type == "response.function_call_arguments.delta" and e.item_id == item_id]
    done = [e for e in events
            if e.type == "response.function_call_arguments.done" and e.item_id == item_id]
    assert len(done) == 1
    assert "".join(deltas) == done[0].arguments
    assert_matches_schema(json.loads(done[0].arguments), WEATHER_SCHEMA)
    assert events[-1].type == "response.completed"
    final_call = _function_calls(events[-1].response)[0]
    assert final_call.arguments == done[0].arguments


def test_named_tool_choice_calls_that_tool(client):
    r = client.responses.create(
        model=MODEL, input="hello", tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "name": "get_time"},
    )
    calls = _function_calls(r)
    assert calls and all(c.name == "get_time" for c in calls)
    assert "city" in json.loads(calls[0].arguments)


def test_allowed_tools_keep_the_model_to_the_allowed_ones(client):
    # The user names the tool that is declared but not allowed this turn.
    r = client.responses.create(
        model=MODEL, input="Please use get_weather for Paris.", tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "allowed_tools", "mode": "required",
                     "tools": [{"type": "function", "name": "get_time"}]},
    )
    calls = _function_calls(r)
    assert calls and all(c.name == "get_time" for c in calls), r.output
    assert r.tool_choice.type == "allowed_tools"


def test_a_tool_choice_naming_an_undeclared_tool_is_refused(client):
    import openai
    import pytest

    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hello", tools=[WEATHER_TOOL],
                                tool_choice={"type": "function", "name": "get_time"})
    assert err.value.body["param"] == "tool_choice"
    assert "get_time" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hello", tool_choice="required")
    assert err.value.body["param"] == "tool_choice"


def test_json_schema_output(client):
    r = client.responses.create(
        model=MODEL,
        input="Describe a city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA,
                         "strict": True}},
    )
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert_matches_schema(value, CITY_SCHEMA)
    assert r.text.format.type == "json_schema"


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int
    coastal: bool


def test_parse_with_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input="Describe a city.", text_format=City)
    assert r.status == "completed"
    parsed = r.output_parsed
    assert isinstance(parsed, City)
    assert parsed == City.model_validate_json(r.output_text)


def test_json_object_output(client):
    r = client.responses.create(model=MODEL, input="Return any JSON object.",
                                text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


def test_tool_choice_none_answers_in_text(client):
    r = client.responses.create(model=MODEL, input="Call get_weather for Paris.",
                                tools=[WEATHER_TOOL], tool_choice="none")
    assert not _function_calls(r)
    assert r.output_text.strip()


def test_tool_choice_auto_calls_a_tool_the_user_names(client):
    r = client.responses.create(model=MODEL, input="Please use get_weather for Paris.",
                                tools=[WEATHER_TOOL], tool_choice="auto")
    calls = _function_calls(r)
    assert calls and calls[0].name == "get_weather"


APPLY_PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}


def test_custom_tool_calls_carry_free_text_input_and_round_trip(client):
    stream = client.responses.create(
        model=MODEL, input="Fix the typo in README.md.", tools=[APPLY_PATCH_TOOL],
        tool_choice={"type": "custom", "name": "apply_patch"}, stream=True,
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status == "completed"
    calls = [item for item in final.output if item.type == "custom_tool_call"]
    assert len(calls) == 1, final.output
    call = calls[0]
    assert call.name == "apply_patch" and call.call_id and call.id.startswith("ctc_")
    assert isinstance(call.input, str) and call.input
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert [e.input for e in done] == [call.input]
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == call.input
    assert not [e for e in events if e.type.startswith("response.function_call_arguments")]

    second = client.responses.create(
        model=MODEL, previous_response_id=final.id, tools=[APPLY_PATCH_TOOL],
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."}],
    )
    assert second.status == "completed" and second.output_text.strip()
    items = list(client.responses.input_items.list(second.id, order="asc", limit=100))
    assert [i.type for i in items] == ["message", "custom_tool_call", "custom_tool_call_output"]
    assert items[1].input == call.input
