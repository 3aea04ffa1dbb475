"""The Conversations API through the official `openai` SDK: conversations and their items, and
responses created in a conversation (`conversation=`), which read its items and add theirs."""

from __future__ import annotations

import openai
import pytest

from conftest import MODEL, TEAM_A_KEY, TEAM_B_KEY


def _texts(items) -> list[tuple[str, str]]:
    return [(i.role, "".join(getattr(p, "text", "") for p in i.content)) for i in items]


def test_responses_in_a_conversation_read_and_extend_it(client):
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
        metadata={"topic": "names"})
    assert conv.object == "conversation" and conv.id.startswith("conv_")
    assert conv.metadata == {"topic": "names"}

    first = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id)
    assert first.conversation.id == conv.id
    assert first.status == "completed" and first.output_text
    second = client.responses.create(model=MODEL, input="And again?",
                                     conversation={"id": conv.id})
    # The second turn saw the first one's input and answer.
    assert second.usage.input_tokens > first.usage.input_tokens

    items = client.conversations.items.list(conv.id, order="asc")
    assert _texts(items.data) == [
        ("user", "My name is Ada."), ("user", "What is my name?"),
        ("assistant", first.output_text), ("user", "And again?"),
        ("assistant", second.output_text)]
    assert not items.has_more
    page = client.conversations.items.list(conv.id, limit=2)
    assert [i.id for i in page.data] == [i.id for i in reversed(items.data)][:2]
    assert page.has_more
    # Continued by its id, a response made in the conversation would leave out the
    # conversation's earlier items: refused, naming the way that keeps them.
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Once more?", previous_response_id=second.id)
    assert err.value.param == "previous_response_id"
    assert conv.id in err.value.message


def test_a_response_without_input_answers_the_conversation_as_it_stands(client):
    conv = client.conversations.create()
    client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "Say hello."}])
    answer = client.responses.create(model=MODEL, conversation=conv.id)
    assert answer.status == "completed" and answer.output_text
    items = client.conversations.items.list(conv.id, order="asc")
    assert _texts(items.data) == [("user", "Say hello."), ("assistant", answer.output_text)]
    # With neither input nor history there is nothing to answer.
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL)
    assert err.value.body["param"] == "input"


def test_conversation_items_and_metadata_can_be_managed(client):
    conv = client.conversations.create()
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "one"},
                        {"type": "message", "role": "user", "content": "two"}])
    assert [i.type for i in added.data] == ["message", "message"]
    one = added.data[0]
    assert client.conversations.items.retrieve(one.id, conversation_id=conv.id).id == one.id
    after = client.conversations.items.delete(one.id, conversation_id=conv.id)
    assert after.id == conv.id
    assert _texts(client.conversations.items.list(conv.id).data) == [("user", "two")]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(one.id, conversation_id=conv.id)
    assert client.conversations.update(conv.id, metadata={"k": "v"}).metadata == {"k": "v"}
    assert client.conversations.retrieve(conv.id).metadata == {"k": "v"}
    assert client.conversations.update(conv.id, metadata=None).metadata == {}
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.object == "conversation.deleted"
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_conversation_errors_name_their_parameter(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.items.create("conv_x", items=[{"type": "message"}])
    assert e.value.param == "items[0].role"
    conv = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.items.create(conv.id, items=[{"type": "item_reference", "id": "m"}])
    assert e.value.param == "items[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.items.create(conv.id, items=[])
    assert (e.value.param, e.value.code) == ("items", "empty_array")
    # An id the conversation holds already, or one given twice: paging by `after` would loop.
    note = {"type": "message", "id": "msg_once", "role": "user", "content": "hi"}
    client.conversations.items.create(conv.id, items=[note])
    for items in ([note], [dict(note, id="msg_new"), dict(note, id="msg_new")]):
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.items.create(conv.id, items=items)
        assert (e.value.param, e.value.code) == ("items", "duplicate_item")
    assert [i.id for i in client.conversations.items.list(conv.id).data] == ["msg_once"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", conversation=conv.id,
                                previous_response_id="resp_x")
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", conversation="conv_missing")
    assert e.value.param == "conversation"


def test_a_conversation_belongs_to_its_team(auth_gateway):
    alpha = auth_gateway.client(api_key=TEAM_A_KEY)
    beta = auth_gateway.client(api_key=TEAM_B_KEY)
    conv = alpha.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        beta.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        beta.conversations.items.list(conv.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.create(model=MODEL, input="x", conversation=conv.id)
    with pytest.raises(openai.NotFoundError):
        beta.conversations.delete(conv.id)
    assert alpha.conversations.retrieve(conv.id).id == conv.id


def test_listed_items_carry_the_fields_the_sdk_requires(client):
    conv = client.conversations.create(items=[
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Look it up."},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "It is 42."}]},
    ])
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output",
                                       "message"]
    # Sent without them; listed as OpenAI lists every item.
    assert [i.status for i in items] == ["completed"] * 4
    assert items[3].content[0].annotations == []
    assert items[0].content[1].detail == "auto"
    again = client.conversations.items.retrieve(items[1].id, conversation_id=conv.id)
    assert again.status == "completed"


def test_a_conversation_runs_one_response_at_a_time(slow_gateway):
    client = slow_gateway.client()
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Plan a parser."}])
    # About 200 ms per token: it runs for minutes unless cancelled.
    running = client.responses.create(model=MODEL, input="Write it all out.",
                                      conversation=conv.id, background=True,
                                      max_output_tokens=4000)
    with pytest.raises(openai.BadRequestError) as locked:
        client.responses.create(model=MODEL, input="meanwhile", conversation=conv.id)
    assert (locked.value.code, locked.value.param) == ("conversation_locked", "conversation")
    with pytest.raises(openai.BadRequestError) as locked:
        client.conversations.items.create(
            conv.id, items=[{"type": "message", "role": "user", "content": "meanwhile"}])
    assert locked.value.code == "conversation_locked"
    # Cancelled, it adds nothing, and the conversation is free at once.
    assert client.responses.cancel(running.id).status == "cancelled"
    after = client.responses.create(model=MODEL, input="Just the outline.",
                                    conversation=conv.id, max_output_tokens=16)
    assert after.status in ("completed", "incomplete")
    items = client.conversations.items.list(conv.id, order="asc")
    assert _texts(items.data) == [("user", "Plan a parser."), ("user", "Just the outline."),
                                  ("assistant", after.output_text)]
