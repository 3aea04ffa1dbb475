"""Team rate limits shared by two `agentgate serve` processes on one Redis, through the SDK.

Two gateway processes with the same store URL and key prefix are one deployment: a team's
requests-per-minute and tokens-per-minute budgets are kept in Redis, so a request admitted by
either process uses up the one budget. A third process with another key prefix on the same
Redis is another deployment with budgets of its own.
"""

from __future__ import annotations

import uuid

import openai
import pytest

from conftest import MODEL, _start, config_toml, hash_key

REQUESTS_KEY = "sk-test-team-requests"
TOKENS_KEY = "sk-test-team-tokens"
# Three requests a minute: a burst of three, then one every 20 s (far longer than the test).
REQUESTS_PER_MINUTE = 3
# Tokens are charged at admission with the estimate input + max_output_tokens; two requests of
# 400 output tokens fit in 1,000, a third does not (the bucket refills about 17 tokens a second).
TOKENS_PER_MINUTE = 1000
MAX_OUTPUT_TOKENS = 400


def _teams(binary: str) -> str:
    return (
        "[[teams]]\n"
        'name = "requests"\n'
        f'api_key_sha256 = ["{hash_key(binary, REQUESTS_KEY)}"]\n'
        f"requests_per_minute = {REQUESTS_PER_MINUTE}\n\n"
        "[[teams]]\n"
        'name = "tokens"\n'
        f'api_key_sha256 = ["{hash_key(binary, TOKENS_KEY)}"]\n'
        f"tokens_per_minute = {TOKENS_PER_MINUTE}\n"
    )


def _config(binary: str, redis_url: str, key_prefix: str) -> str:
    return config_toml(time_scale=0, replicas=1, store_url=redis_url, key_prefix=key_prefix,
                       extra=_teams(binary))


@pytest.fixture(scope="module")
def deployment(agentgate_bin, workdir, redis_url):
    """Two gateway processes sharing one Redis and one key prefix."""
    prefix = f"agentgate-pytest-shared-{uuid.uuid4().hex[:12]}:"
    config = _config(agentgate_bin, redis_url, prefix)
    first = _start(agentgate_bin, "shared-a", config, workdir)
    second = _start(agentgate_bin, "shared-b", config, workdir)
    a, b = next(first), next(second)
    try:
        yield a, b
    finally:
        for gen in (second, first):
            gen.close()


def _create(gw, key: str, **extra):
    return gw.client(api_key=key).responses.with_raw_response.create(
        model=MODEL, input="hello there", **extra)


def test_requests_per_minute_is_one_budget_across_processes(deployment, agentgate_bin, workdir,
                                                             redis_url):
    a, b = deployment
    assert a.proc.pid != b.proc.pid
    remaining = []
    for gw in (a, b, a):
        raw = _create(gw, REQUESTS_KEY)
        assert raw.parse().status == "completed"
        assert raw.headers["x-ratelimit-limit-requests"] == str(REQUESTS_PER_MINUTE)
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"], "each process counts the other's requests"

    for gw in (b, a):
        with pytest.raises(openai.RateLimitError) as e:
            _create(gw, REQUESTS_KEY)
        err = e.value
        assert err.status_code == 429
        assert err.code == "rate_limit_exceeded_requests"
        assert err.type == "requests"
        retry_after = int(err.response.headers["retry-after"])
        assert 1 <= retry_after <= 20, retry_after
        assert err.response.headers["x-ratelimit-remaining-requests"] == "0"

    # Another deployment (key prefix) on the same Redis keeps its own budget.
    other_config = _config(agentgate_bin, redis_url,
                           f"agentgate-pytest-other-{uuid.uuid4().hex[:12]}:")
    other_gen = _start(agentgate_bin, "other", other_config, workdir)
    other = next(other_gen)
    try:
        raw = _create(other, REQUESTS_KEY)
        assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    finally:
        other_gen.close()


def test_tokens_per_minute_is_one_budget_across_processes(deployment):
    a, b = deployment
    first = _create(a, TOKENS_KEY, max_output_tokens=MAX_OUTPUT_TOKENS)
    assert first.parse().status == "completed"
    left_after_a = int(first.headers["x-ratelimit-remaining-tokens"])
    assert left_after_a <= TOKENS_PER_MINUTE - MAX_OUTPUT_TOKENS

    second = _create(b, TOKENS_KEY, max_output_tokens=MAX_OUTPUT_TOKENS)
    assert second.parse().status == "completed"
    left_after_b = int(second.headers["x-ratelimit-remaining-tokens"])
    # b charged the budget a had already charged (a fresh budget would leave b what a had
    # left); the slack is what the bucket refills in a few seconds.
    assert left_after_b <= left_after_a - MAX_OUTPUT_TOKENS + 100, (left_after_a, left_after_b)

    with pytest.raises(openai.RateLimitError) as e:
        _create(a, TOKENS_KEY, max_output_tokens=MAX_OUTPUT_TOKENS)
    assert e.value.code == "rate_limit_exceeded_tokens"
    assert e.value.type == "tokens"
    assert int(e.value.response.headers["retry-after"]) >= 1
