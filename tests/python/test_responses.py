"""The core Responses API through the official `openai` SDK: create, streaming (raw events and the
`responses.stream` helper), chaining with `previous_response_id`, retrieve, delete, input items."""

from __future__ import annotations

import openai
import pytest

from conftest import ALIAS, MODEL, SLASHED_ALIAS, TEAM_A_KEY, TEAM_B_KEY


def _usage_is_complete(usage) -> None:
    assert usage is not None, "a finished response carries usage"
    assert usage.input_tokens > 0
    assert usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert isinstance(usage.input_tokens_details.cached_tokens, int)
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert isinstance(usage.output_tokens_details.reasoning_tokens, int)
    assert 0 <= usage.output_tokens_details.reasoning_tokens <= usage.output_tokens


def test_create_returns_completed_response_with_text_and_usage(client):
    r = client.responses.create(model=MODEL, input="Name three prime numbers.")
    assert r.object == "response"
    assert r.id.startswith("resp_")
    assert r.status == "completed"
    assert r.model == MODEL
    assert r.error is None and r.incomplete_details is None
    assert r.output_text.strip(), "output_text must not be empty"
    messages = [item for item in r.output if item.type == "message"]
    assert len(messages) == 1
    assert messages[0].role == "assistant" and messages[0].status == "completed"
    assert messages[0].id.startswith("msg_")
    _usage_is_complete(r.usage)


def test_create_echoes_request_settings(client):
    r = client.responses.create(model=MODEL, input="hi", instructions="Answer briefly.",
                                temperature=0.3, metadata={"ticket": "T-1"})
    assert r.instructions == "Answer briefly."
    assert r.temperature == pytest.approx(0.3)
    assert r.metadata == {"ticket": "T-1"}
    assert r.store is True


def test_model_alias_is_served(client):
    r = client.responses.create(model=ALIAS, input="hello")
    assert r.status == "completed"
    assert r.output_text
    models = {m.id for m in client.models.list()}
    assert {MODEL, ALIAS, SLASHED_ALIAS} <= models
    assert client.models.retrieve(SLASHED_ALIAS).id == SLASHED_ALIAS
    assert client.models.retrieve(ALIAS).id == ALIAS


def test_raw_stream_event_order_and_sequence(client):
    stream = client.responses.create(model=MODEL, input="Stream a haiku.", stream=True)
    events = list(stream)
    types = [e.type for e in events]

    assert [e.sequence_number for e in events] == list(range(len(events))), \
        "sequence_number must count 0..n-1 without gaps"
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas, "at least one output_text.delta"
    first_delta = types.index("response.output_text.delta")
    last_delta = len(types) - 1 - types[::-1].index("response.output_text.delta")
    assert first_delta == 4
    assert all(t == "response.output_text.delta" for t in types[first_delta:last_delta + 1])
    assert types[last_delta + 1:] == ["response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", "response.completed"]

    created, in_progress = events[0].response, events[1].response
    assert created.status == "in_progress" and in_progress.status == "in_progress"
    assert created.id == in_progress.id
    added = events[2]
    assert added.item.type == "message" and added.output_index == 0
    item_id = added.item.id
    assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0
               for d in deltas)

    text = "".join(d.delta for d in deltas)
    assert text.strip()
    text_done = events[last_delta + 1]
    assert text_done.text == text
    assert events[last_delta + 2].part.text == text
    item_done = events[last_delta + 3]
    assert item_done.item.id == item_id and item_done.item.status == "completed"
    assert item_done.item.content[0].text == text

    completed = events[-1].response
    assert completed.id == created.id
    assert completed.status == "completed"
    assert completed.output_text == text
    _usage_is_complete(completed.usage)


def test_stream_helper_final_response(client):
    deltas = []
    with client.responses.stream(model=MODEL, input="Stream a haiku.") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert final.output_text.strip()
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text


def test_log_probabilities_come_with_the_text_when_included(client):
    include = ["message.output_text.logprobs"]
    r = client.responses.create(model=MODEL, input="Answer briefly.", include=include,
                                top_logprobs=2, max_output_tokens=16)
    part = r.output[-1].content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob < 0 for lp in part.logprobs)
    assert client.responses.retrieve(r.id).output[-1].content[0].logprobs == part.logprobs
    # Streamed: each text delta carries its tokens' log probabilities.
    streamed = []
    with client.responses.stream(model=MODEL, input="Answer briefly.", include=include) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                assert "".join(lp.token for lp in event.logprobs) == event.delta
                streamed.extend(event.logprobs)
        final = stream.get_final_response()
    assert streamed and len(final.output[-1].content[0].logprobs) == len(streamed)
    # Not asked for: none.
    plain = client.responses.create(model=MODEL, input="Answer briefly.", max_output_tokens=16)
    assert not plain.output[-1].content[0].logprobs


def test_streamed_response_is_stored_when_the_terminal_event_arrives(client):
    with client.responses.stream(model=MODEL, input="one") as stream:
        final = stream.get_final_response()
    # The terminal event is sent after the response is stored: chaining at once must work.
    second = client.responses.create(model=MODEL, input="two", previous_response_id=final.id)
    assert second.status == "completed"


def test_chaining_grows_the_context(client):
    first = client.responses.create(model=MODEL, input="My name is Ada and I write compilers.")
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id)
    third = client.responses.create(model=MODEL, input="And what do I write?",
                                    previous_response_id=second.id)
    assert second.previous_response_id == first.id
    assert third.previous_response_id == second.id
    for r in (first, second, third):
        assert r.status == "completed" and r.output_text
    # Each turn sees every earlier input and output, so its prompt is longer than the last one.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert third.usage.input_tokens > second.usage.input_tokens


def test_instructions_are_not_inherited(client):
    first = client.responses.create(model=MODEL, input="hi", instructions="Speak like a pirate.")
    second = client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    assert first.instructions == "Speak like a pirate."
    assert second.instructions is None


def test_retrieve_returns_the_stored_response(client):
    r = client.responses.create(model=MODEL, input="Remember this.")
    got = client.responses.retrieve(r.id)
    assert got.id == r.id
    assert got.status == "completed"
    assert got.output_text == r.output_text
    assert got.usage.input_tokens == r.usage.input_tokens
    assert got.usage.output_tokens == r.usage.output_tokens
    assert [i.id for i in got.output] == [i.id for i in r.output]


def test_delete_then_retrieve_is_not_found(client):
    r = client.responses.create(model=MODEL, input="Forget this.")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_delete_of_unknown_id_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_does_not_exist")


def _chain(client, prompts):
    previous = None
    responses = []
    for prompt in prompts:
        r = client.responses.create(model=MODEL, input=prompt, previous_response_id=previous)
        responses.append(r)
        previous = r.id
    return responses


def test_input_items_paginate_with_after(client):
    prompts = ["turn one", "turn two", "turn three", "turn four"]
    chain = _chain(client, prompts)
    last = chain[-1]
    # Input of the last turn: every earlier user message and assistant output, then its own input.
    expected = 2 * len(prompts) - 1

    pages, after = [], None
    while True:
        kwargs = {"limit": 2, "order": "asc"}
        if after is not None:
            kwargs["after"] = after
        page = client.responses.input_items.list(last.id, **kwargs)
        assert len(page.data) <= 2
        pages.append(page)
        if not page.has_more:
            break
        assert page.data, "a page with has_more must not be empty"
        after = page.data[-1].id
        assert len(pages) <= expected, "pagination does not terminate"
    asc = [item for page in pages for item in page.data]
    ids = [item.id for item in asc]
    assert len(ids) == expected
    assert len(set(ids)) == expected, "item ids must be unique"
    assert all(ids), "every input item has an id"
    assert pages[0].first_id == ids[0] and pages[-1].last_id == ids[-1]

    # Order: user, assistant, user, assistant, ..., user (the conversation as the model saw it).
    roles = [getattr(item, "role", None) for item in asc]
    assert roles == ["user", "assistant"] * (len(prompts) - 1) + ["user"]
    user_texts = [item.content[0].text for item in asc if item.role == "user"]
    assert user_texts == prompts
    assistant_ids = [item.id for item in asc if item.role == "assistant"]
    assert assistant_ids == [r.output[0].id for r in chain[:-1]]

    desc = client.responses.input_items.list(last.id, limit=100, order="desc")
    assert [item.id for item in desc.data] == ids[::-1]
    assert desc.has_more is False

    # The SDK's auto-pagination (default order desc) walks the same items.
    auto = [item.id for item in client.responses.input_items.list(last.id, limit=3)]
    assert auto == ids[::-1]


def test_input_items_reject_bad_limit_and_unknown_after(client):
    r = client.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, limit=0)
    assert e.value.param == "limit"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, after="msg_not_in_this_response")
    assert e.value.param == "after"


def test_input_tokens_counts_like_create(client):
    counted = client.responses.input_tokens.count(model=MODEL, input="Count these words please.")
    created = client.responses.create(model=MODEL, input="Count these words please.")
    assert counted.input_tokens == created.usage.input_tokens


def test_ill_typed_nested_fields_name_their_path(client):
    tool = {"type": "function", "name": "read file", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[tool])
    assert (e.value.param, e.value.code) == ("tools[0].name", "invalid_value")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", text={"format": {"name": "s"}})
    assert (e.value.param, e.value.code) == ("text.format.type", "missing_required_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", service_tier="fastest")
    assert (e.value.param, e.value.code) == ("service_tier", "invalid_value")


def test_streaming_a_stored_response_is_refused_not_ignored(client):
    r = client.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.retrieve(r.id, stream=True)
    assert (e.value.param, e.value.code) == ("stream", "unsupported_parameter")
    assert client.responses.retrieve(r.id).id == r.id


def test_compact_then_continue_from_the_compacted_history(client):
    first = client.responses.create(model=MODEL, input="My name is Ada and I write compilers.")
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id)
    compacted = client.responses.compact(model=MODEL, previous_response_id=second.id,
                                         input="Now help me with the parser.")
    assert compacted.object == "response.compaction"
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message", "message", "message", "compaction"], kinds
    users = [item.content[0].text for item in compacted.output[:3]]
    assert users == ["My name is Ada and I write compilers.", "What is my name?",
                     "Now help me with the parser."]
    assert compacted.output[-1].encrypted_content
    _usage_is_complete(compacted.usage)

    # As sent back: what the gateway returned (exclude_unset); the SDK types the user messages
    # of a compaction's output as output messages, hence no serializer warnings.
    history = [item.to_dict(warnings=False) for item in compacted.output]
    ask = {"role": "user", "content": "Go on."}
    continued = client.responses.create(model=MODEL, input=history + [ask])
    fresh = client.responses.create(model=MODEL, input=[ask])
    assert continued.status == "completed" and continued.output_text
    # The summary is part of the prompt the engine saw.
    assert continued.usage.input_tokens > fresh.usage.input_tokens + compacted.usage.output_tokens // 2
    counted = client.responses.input_tokens.count(model=MODEL, input=history + [ask])
    assert counted.input_tokens == continued.usage.input_tokens


def test_a_compaction_item_from_elsewhere_is_refused(client):
    foreign = {"type": "compaction", "encrypted_content": "gAAAAABpZ2VuY3J5cHRlZA=="}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[foreign, {"role": "user", "content": "hi"}])
    assert (e.value.param, e.value.code) == ("input[0].encrypted_content",
                                             "invalid_encrypted_content")


def test_item_references_without_a_chain_find_the_stored_items(client, auth_gateway):
    """The whole history in `input`, earlier answers by reference and no previous_response_id,
    as the Vercel AI SDK sends a conversation with `store` on."""
    first = client.responses.create(model=MODEL, input="Say something.")
    said = first.output[-1].id
    asked = {"role": "user", "content": "Say something."}
    follow_up = {"role": "user", "content": "and then?"}
    without = client.responses.create(model=MODEL, input=[asked, follow_up])
    r = client.responses.create(
        model=MODEL, input=[asked, {"type": "item_reference", "id": said}, follow_up])
    assert r.status == "completed"
    # The referenced answer reached the engine, and is stored as the turn's input.
    assert r.usage.input_tokens > without.usage.input_tokens
    assert said in [item.id for item in client.responses.input_items.list(r.id).data]

    # Another team's stored items are not found by their ids.
    a, b = auth_gateway.client(api_key=TEAM_A_KEY), auth_gateway.client(api_key=TEAM_B_KEY)
    theirs = a.responses.create(model=MODEL, input="Say something.").output[-1].id
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model=MODEL, input=[asked, {"type": "item_reference", "id": theirs}])
    assert (e.value.param, e.value.code) == ("input[1]", "item_not_found")


def test_item_references_resolve_against_the_previous_response(client):
    first = client.responses.create(model=MODEL, input="Say something.")
    said = first.output[-1].id
    # With its type, or as a bare id (the type is optional).
    for ref in ({"type": "item_reference", "id": said}, {"id": said}):
        r = client.responses.create(model=MODEL, previous_response_id=first.id,
                                    input=[ref, {"role": "user", "content": "and then?"}])
        assert r.status == "completed"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id,
                                input=[{"role": "user", "content": "x"}, {"id": "msg_unknown"}])
    assert e.value.param == "input[1]"
    assert e.value.code == "item_not_found"
    # An error in an item after a resolved reference names the item as sent.
    by_file = {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id,
                                input=[{"id": said}, by_file])
    assert e.value.param == "input[1].content[0].image_url"
    assert "input[1].content[0]" in str(e.value) and "input[0]" not in str(e.value)


def test_an_item_id_the_conversation_already_holds_is_refused(client):
    first = client.responses.create(model=MODEL, input="Say something.")
    said = first.output[-1].model_dump(exclude_none=True)
    # Sent again after previous_response_id, which already holds it.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id,
                                input=[said, {"role": "user", "content": "and then?"}])
    assert (e.value.param, e.value.code) == ("input", "duplicate_item")
    assert said["id"] in str(e.value)
    # Twice in one input.
    note = {"type": "message", "id": "msg_twice", "role": "user", "content": "hi"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[note, note])
    assert (e.value.param, e.value.code) == ("input", "duplicate_item")


def test_a_content_part_the_api_does_not_know_is_refused_not_dropped(client):
    for part in ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                 {"type": "input_txt", "text": "typo"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=[
                {"role": "user", "content": [{"type": "input_text", "text": "look"}, part]}])
        assert e.value.param == "input[0].content[1].type"
