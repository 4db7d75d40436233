"""Drives `engrun serve` with the official `openai` package (run by tests/server.rs).

usage: openai_client.py BASE_URL MODEL smollm2 QUESTION ANSWER
       openai_client.py BASE_URL MODEL unicode

Both modes end with the error cases, read through the package's exception classes (status,
and OpenAI's `type`, `param` and `code`).
"""
import sys

import openai
from openai import OpenAI

base, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base, api_key="test-key", max_retries=0, timeout=300)


def chat(**kw):
    return client.chat.completions.create(model=model, **kw)


def streamed_chat(**kw):
    pieces, finish, usage = [], None, None
    for chunk in chat(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    return pieces, finish, usage


def expect_error(kind, status, param, code=None, key="test-key", **kw):
    try:
        OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(**kw)
    except kind as e:
        assert e.status_code == status, (e.status_code, e)
        assert (e.type, e.param, e.code) == ("invalid_request_error", param, code), (e.type, e.param, e.code, e)
        return
    raise AssertionError(f"no {kind.__name__} for {kw}")


def check_errors(msgs):
    expect_error(openai.NotFoundError, 404, "model", "model_not_found", model="no-such-model", messages=msgs)
    expect_error(openai.BadRequestError, 400, "messages", model=model, messages=[])
    expect_error(openai.BadRequestError, 400, "temperature", model=model, messages=msgs, temperature=-1)
    expect_error(openai.BadRequestError, 400, "top_p", model=model, messages=msgs, top_p=1.5)
    expect_error(openai.BadRequestError, 400, "max_tokens", model=model, messages=msgs, max_tokens=-1)
    expect_error(openai.BadRequestError, 400, "max_tokens", model=model, messages=msgs, max_tokens=10**6)
    expect_error(openai.BadRequestError, 400, "n", model=model, messages=msgs, n=100)
    expect_error(openai.AuthenticationError, 401, None, "invalid_api_key", key="wrong", model=model, messages=msgs)
    assert [m.id for m in client.models.list().data] == [model]


if mode == "smollm2":
    question, answer = sys.argv[4], sys.argv[5]
    msgs = [{"role": "user", "content": question}]
    r = chat(messages=msgs, temperature=0, max_tokens=48)
    assert r.choices[0].message.content == answer, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    # Content as a list of text parts renders the same.
    parts = [{"role": "user", "content": [{"type": "text", "text": question}]}]
    assert chat(messages=parts, temperature=0, max_tokens=48).choices[0].message.content == answer
    # Streamed text equals the non-streamed text; usage comes last; the prefix is cached now.
    pieces, finish, usage = streamed_chat(messages=msgs, temperature=0, max_tokens=48)
    assert "".join(pieces) == answer and finish == "stop", (pieces, finish)
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0, usage
    # Length limit.
    r = chat(messages=msgs, temperature=0, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    # A stop string is never sent, even when it is split across tokens.
    r = chat(messages=msgs, temperature=0, max_tokens=48, stop=["Par"])
    assert r.choices[0].message.content == answer.split("Par")[0], r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    pieces, finish, _ = streamed_chat(messages=msgs, temperature=0, max_tokens=48, stop="is Paris")
    assert "".join(pieces) == answer.split("is Paris")[0] and finish == "stop", pieces
    # n = 2, seeded sampling: reproducible.
    r1 = chat(messages=msgs, temperature=1.0, n=2, seed=7, max_tokens=12)
    r2 = chat(messages=msgs, temperature=1.0, n=2, seed=7, max_tokens=12)
    assert len(r1.choices) == 2 and [c.index for c in r1.choices] == [0, 1]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    # Logprobs.
    r = chat(messages=msgs, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lp)
    assert all(t.logprob <= 0 and t.top_logprobs[0].token == t.token for t in lp)
    # Completions: text, token ids, a list of prompts; streaming; logprobs.
    c = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
    text = c.choices[0].text
    assert len(text) > 0 and c.usage.completion_tokens == 4
    ids = client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=2)
    assert len(ids.choices) == 1
    many = client.completions.create(model=model, prompt=["Hello", "The capital of France is"], temperature=0, max_tokens=4)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[1].text == text
    s = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4, stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == text
    c = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=3, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 3 and len(c.choices[0].logprobs.top_logprobs[0]) == 2
    check_errors(msgs)
elif mode == "unicode":
    for prompt in ["你好，世界！请介绍一下长城。", "Emoji: 😀🎉👍🏽 and 🇫🇷, 日本語も", "한국어 텍스트와 中文混合"]:
        msgs = [{"role": "user", "content": prompt}]
        whole = chat(messages=msgs, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
        text = whole.choices[0].message.content
        pieces, _, _ = streamed_chat(messages=msgs, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
        assert "".join(pieces) == text, (pieces, text)
        # No piece carries a broken character that the whole text does not.
        assert sum(p.count("\ufffd") for p in pieces) == text.count("\ufffd"), pieces
    check_errors([{"role": "user", "content": "hi"}])
else:
    raise SystemExit(f"unknown mode {mode}")
print("ok")
