"""Background responses, cancellation, `store: false`, and the error contract, through the SDK."""

from __future__ import annotations

import subprocess
import time

import openai
import pytest

from conftest import MODEL, TEAM_A_KEY, TEAM_B_KEY, hash_key

POLL_DEADLINE_S = 60.0


def _poll_until_done(client, response_id):
    deadline = time.monotonic() + POLL_DEADLINE_S
    seen = []
    while time.monotonic() < deadline:
        r = client.responses.retrieve(response_id)
        seen.append(r.status)
        if r.status not in ("queued", "in_progress"):
            return r, seen
        time.sleep(0.05)
    pytest.fail(f"background response {response_id} still {seen[-1]} after "
                f"{POLL_DEADLINE_S}s (statuses seen: {sorted(set(seen))})")


def test_background_response_completes(client):
    r = client.responses.create(model=MODEL, input="Work on this in the background.",
                                background=True)
    assert r.background is True
    assert r.status in ("queued", "in_progress")
    assert r.output == [] and r.usage is None
    done, _ = _poll_until_done(client, r.id)
    assert done.status == "completed"
    assert done.background is True
    assert done.output_text.strip()
    assert done.usage.output_tokens > 0
    chained = client.responses.create(model=MODEL, input="and then?",
                                      previous_response_id=r.id)
    assert chained.status == "completed"


def test_background_response_streams_again_with_retrieve(slow_gateway):
    client = slow_gateway.client()
    r = client.responses.create(model=MODEL, input="Tell me a story.", background=True,
                                max_output_tokens=16)
    # Followed while it runs: every event from the first, then the rest after one of them.
    events = list(client.responses.retrieve(r.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [(e.type, e.response.status) for e in events[:3]] == [
        ("response.created", "queued"), ("response.queued", "queued"),
        ("response.in_progress", "in_progress")]
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.id == r.id and final.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == final.output_text
    rest = list(client.responses.retrieve(r.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in rest] == list(range(4, len(events)))
    assert client.responses.retrieve(r.id).output_text == final.output_text


def test_a_streamed_background_response_is_announced_as_queued_then_runs(client):
    events = list(client.responses.create(model=MODEL, input="Stream this in the background.",
                                          background=True, stream=True,
                                          max_output_tokens=16))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:3]] == [
        "response.created", "response.queued", "response.in_progress"]
    assert events[1].response.status == "queued" and events[1].response.background
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(events[0].response.id).output_text \
        == events[-1].response.output_text


def test_background_requires_store(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert e.value.param == "background"


def test_cancel_background_response(slow_gateway):
    client = slow_gateway.client()
    r = client.responses.create(model=MODEL, input="Write a very long story.", background=True,
                                max_output_tokens=4000)
    assert r.status in ("queued", "in_progress")
    # Nothing to continue from while it runs, nor once it is cancelled.
    with pytest.raises(openai.BadRequestError) as running:
        client.responses.create(model=MODEL, input="and then?", previous_response_id=r.id)
    assert running.value.param == "previous_response_id"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.id == r.id
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    # Cancelling again is idempotent.
    assert client.responses.cancel(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=MODEL, input="and then?", previous_response_id=r.id)
    assert gone.value.param == "previous_response_id"
    assert "cancelled" in gone.value.message


def test_cancel_of_foreground_response_is_rejected(client):
    r = client.responses.create(model=MODEL, input="quick")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)
    assert client.responses.retrieve(r.id).status == "completed"


def test_cancel_of_unknown_response_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_does_not_exist")


def test_store_false_is_returned_but_not_kept(client):
    r = client.responses.create(model=MODEL, input="Do not keep this.", store=False)
    assert r.status == "completed"
    assert r.store is False
    assert r.output_text.strip()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="next", previous_response_id=r.id)
    assert e.value.code == "previous_response_not_found"
    assert e.value.param == "previous_response_id"


def test_store_false_stream_is_not_kept(client):
    with client.responses.stream(model=MODEL, input="stream, do not keep", store=False) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)


def test_unknown_previous_response_id(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi",
                                previous_response_id="resp_0123456789abcdef")
    err = e.value
    assert err.status_code == 400
    assert err.code == "previous_response_not_found"
    assert err.param == "previous_response_id"
    assert err.type == "invalid_request_error"
    assert "resp_0123456789abcdef" in err.message


def test_unknown_model_is_not_found(client):
    # 400, as the Responses API answers it (Chat Completions answers 404).
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="no-such-model", input="hi")
    assert e.value.code == "model_not_found"
    assert e.value.param == "model"


def test_max_output_tokens_makes_response_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long essay about compilers.",
                                max_output_tokens=16)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 16
    assert r.max_output_tokens == 16


def test_max_output_tokens_incomplete_when_streamed(client):
    events = list(client.responses.create(model=MODEL, input="Write a long essay.",
                                          max_output_tokens=16, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "response.completed" not in [e.type for e in events]


def test_max_output_tokens_below_minimum(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=15)
    assert e.value.param == "max_output_tokens"


def test_invalid_parameters_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", temperature=3)
    assert e.value.param == "temperature"


def test_wrong_api_key_is_rejected(auth_gateway):
    bad = auth_gateway.client(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        bad.responses.create(model=MODEL, input="hi")
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_right_api_key_is_accepted(auth_gateway):
    r = auth_gateway.client(api_key=TEAM_A_KEY).responses.create(model=MODEL, input="hi")
    assert r.status == "completed"


def test_team_isolation(auth_gateway):
    alpha = auth_gateway.client(api_key=TEAM_A_KEY)
    beta = auth_gateway.client(api_key=TEAM_B_KEY)
    mine = alpha.responses.create(model=MODEL, input="alpha's secret")

    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.input_items.list(mine.id)
    with pytest.raises(openai.BadRequestError) as e:
        beta.responses.create(model=MODEL, input="steal", previous_response_id=mine.id)
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(mine.id)

    # Beta's attempts changed nothing for alpha.
    assert alpha.responses.retrieve(mine.id).output_text == mine.output_text
    follow = alpha.responses.create(model=MODEL, input="continue", previous_response_id=mine.id)
    assert follow.status == "completed"


def test_streaming_request_errors_arrive_as_http_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", stream=True,
                                previous_response_id="resp_0123456789abcdef")
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="no-such-model", input="hi", stream=True)


def test_forks_see_their_own_history(client):
    root = client.responses.create(model=MODEL, input="root turn")
    left = client.responses.create(model=MODEL, input="left branch", previous_response_id=root.id)
    right = client.responses.create(model=MODEL, input="right branch",
                                    previous_response_id=root.id)
    for branch, text in ((left, "left branch"), (right, "right branch")):
        items = list(client.responses.input_items.list(branch.id, order="asc"))
        assert [i.role for i in items] == ["user", "assistant", "user"]
        assert items[0].content[0].text == "root turn"
        assert items[1].id == root.output[0].id
        assert items[2].content[0].text == text


def test_completed_response_has_completed_at(client):
    r = client.responses.create(model=MODEL, input="hi")
    assert r.completed_at is not None and r.completed_at >= r.created_at


def test_turn_finishes_and_is_stored_after_client_disconnects(slow_gateway):
    client = slow_gateway.client()
    stream = client.responses.create(model=MODEL, input="Tell me a story.", stream=True,
                                     max_output_tokens=16)
    response_id = None
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert response_id is not None
    deadline = time.monotonic() + POLL_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            stored = client.responses.retrieve(response_id)
            break
        except openai.NotFoundError:
            time.sleep(0.1)
    else:
        pytest.fail(f"{response_id} was never stored after the client disconnected")
    assert stored.status == "incomplete"
    assert stored.usage.output_tokens == 16


def test_hash_key_takes_the_key_from_standard_input_too(agentgate_bin):
    """`agentgate hash-key` without an argument hashes the first line of standard input, so a
    key need not appear in shell history or process lists."""
    piped = subprocess.run([agentgate_bin, "hash-key"], input=TEAM_A_KEY + "\n",
                           capture_output=True, text=True, check=True)
    assert piped.stdout.strip() == hash_key(agentgate_bin, TEAM_A_KEY)
    # Surrounding whitespace is not part of a key (a bearer token is read trimmed too).
    padded = subprocess.run([agentgate_bin, "hash-key", f"  {TEAM_A_KEY}\t"],
                            capture_output=True, text=True, check=True)
    assert padded.stdout.strip() == piped.stdout.strip()
    empty = subprocess.run([agentgate_bin, "hash-key"], input="", capture_output=True, text=True)
    assert empty.returncode != 0 and "no key given" in empty.stderr


def test_a_background_response_lost_with_its_gateway_fails_instead_of_staying_queued(
        agentgate_bin, workdir, redis_url):
    """A gateway process killed (SIGKILL: no shutdown) while it runs a background response:
    another gateway on the same Redis stores it `failed` once the run's lease lapses, so a
    client polling or following it gets an answer instead of `in_progress` until the TTL."""
    import uuid

    from conftest import _start, config_toml

    config = config_toml(time_scale=1.0, replicas=1, decode_ms_per_token=200,
                         store_url=redis_url,
                         key_prefix=f"agentgate-pytest-orphan-{uuid.uuid4().hex[:12]}:",
                         extra="[background]\norphaned_after_s = 2\n")
    doomed_gen = _start(agentgate_bin, "orphan-a", config, workdir)
    survivor_gen = _start(agentgate_bin, "orphan-b", config, workdir)
    doomed, survivor = next(doomed_gen), next(survivor_gen)
    try:
        r = doomed.client().responses.create(model=MODEL, input="Take your time.",
                                             background=True, max_output_tokens=500)
        client = survivor.client()
        # Running on the first gateway, renewing its lease: the second leaves it alone.
        time.sleep(3)
        assert client.responses.retrieve(r.id).status in ("queued", "in_progress")
        doomed.proc.kill()
        doomed.proc.wait(timeout=10)

        done, seen = _poll_until_done(client, r.id)
        assert done.status == "failed", seen
        assert done.error.code == "server_error"
        # A follow of its events ends too, with the stored failure.
        events = list(client.responses.retrieve(r.id, stream=True))
        assert events[-1].type == "response.failed", [e.type for e in events]
        assert events[-1].response.error.code == "server_error"
        # It has no answer to continue from.
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="and?", previous_response_id=r.id)
        assert e.value.param == "previous_response_id"
        assert "failed" in e.value.message
    finally:
        survivor_gen.close()
        doomed_gen.close()
