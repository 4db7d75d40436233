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


def expect_error_completion(param, **kw):
    try:
        client.completions.create(model=model, prompt="hi", **kw)
    except openai.BadRequestError as e:
        assert (e.status_code, e.type, e.param) == (400, "invalid_request_error", param), (e.param, e)
        return
    raise AssertionError(f"no 400 for {kw}")


def http_tokenize(text):
    """The ids of `text` by the server's /tokenize (no special tokens); one id for a token string."""
    root = base.rsplit("/v1", 1)[0]
    r = client._client.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                            headers={"Authorization": f"Bearer {client.api_key}"}).json()
    ids = r["tokens"]
    return ids[0] if len(ids) == 1 else ids


def check_api(msgs):
    """What clients send works or is refused: sampling seeds, defaults, validation of every
    field the server does not implement, the model, tokenize and detokenize endpoints."""
    # Unseeded sampling differs from request to request; seeded sampling repeats.
    story = [{"role": "user", "content": "Tell me a story about a dragon."}]
    texts = {chat(messages=story, temperature=1.0, max_tokens=16).choices[0].message.content for _ in range(5)}
    assert len(texts) > 1, texts
    seeded = {chat(messages=story, temperature=1.0, max_tokens=16, seed=3).choices[0].message.content for _ in range(3)}
    assert len(seeded) == 1, seeded
    # OpenAI's default max_tokens of /v1/completions is 16.
    c = client.completions.create(model=model, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 16 and c.choices[0].finish_reason == "length", c.usage
    assert c.created >= client.models.retrieve(model).created
    # Harmless fields are accepted, and so are the neutral values of unimplemented ones.
    r = chat(messages=msgs, temperature=0, max_tokens=3, user="u1", metadata={"k": "v"}, store=False,
             service_tier="auto", logit_bias={}, response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].finish_reason == "length"
    # Everything else that would change the answer is a 400 naming the field.
    expect_error(openai.BadRequestError, 400, "messages", model=model, messages=[{"role": "wizard", "content": "hi"}])
    expect_error(openai.BadRequestError, 400, "messages", model=model, messages=[{"role": "user", "content": None}])
    # Malformed tool-calling turns of the history (check_tools sends good ones).
    call = {"id": "c1", "type": "function", "function": {"name": "answer", "arguments": '{"q": '}}
    turns = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    expect_error(openai.BadRequestError, 400, "messages", model=model, messages=turns)
    # logit_bias: -100 on the greedy first token changes the answer; +100 on a token forces it.
    greedy = chat(messages=msgs, temperature=0, max_tokens=1, logprobs=True, top_logprobs=1)
    first = http_tokenize(greedy.choices[0].logprobs.content[0].token)
    banned = chat(messages=msgs, temperature=0, max_tokens=1, logit_bias={str(first): -100})
    assert banned.choices[0].message.content != greedy.choices[0].message.content, banned
    forced = chat(messages=msgs, temperature=1.0, max_tokens=3, logit_bias={"17": 100})
    assert forced.usage.completion_tokens == 3
    root = base.rsplit("/v1", 1)[0]
    want = client._client.post(root + "/detokenize", json={"tokens": [17, 17, 17]},
                               headers={"Authorization": f"Bearer {client.api_key}"}).json()["text"]
    assert forced.choices[0].message.content == want, (forced.choices[0].message.content, want)
    expect_error(openai.BadRequestError, 400, "logit_bias", model=model, messages=msgs, logit_bias={"5": 300})
    # min_tokens: eos is held back until then (the greedy answer stops well before 24 tokens).
    short = chat(messages=msgs, temperature=0, max_tokens=24)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 24, short.usage
    held = chat(messages=msgs, temperature=0, max_tokens=24, extra_body={"min_tokens": 24})
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 24, held.usage
    assert held.choices[0].message.content.startswith(short.choices[0].message.content), held.choices[0].message.content
    expect_error(openai.BadRequestError, 400, "min_tokens", model=model, messages=msgs, extra_body={"min_tokens": -1})
    expect_error(openai.BadRequestError, 400, "response_format", model=model, messages=msgs,
                 response_format={"type": "bogus"})
    expect_error(openai.BadRequestError, 400, "regex", model=model, messages=msgs,
                 response_format={"type": "json_object"}, extra_body={"regex": "a+"})
    expect_error(openai.BadRequestError, 400, "tool_choice", model=model, messages=msgs, tool_choice="required")
    expect_error(openai.BadRequestError, 400, "top_logprobs", model=model, messages=msgs, top_logprobs=2)
    expect_error(openai.BadRequestError, 400, "stop_token_ids", model=model, messages=msgs,
                 extra_body={"stop_token_ids": [10**8]})
    expect_error(openai.BadRequestError, 400, "frobnicate", model=model, messages=msgs, extra_body={"frobnicate": 1})
    expect_error(openai.BadRequestError, 400, "presence_penalty", model=model, messages=msgs, presence_penalty=5)
    expect_error(openai.BadRequestError, 400, "temperature", model=model, messages=msgs,
                 extra_body={"temperature": "hot"})
    # echo: the prompt, then the completion (streamed: the prompt first); not with logprobs.
    plain = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
    e = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4, echo=True)
    assert e.choices[0].text == "The capital of France is" + plain.choices[0].text, e.choices[0].text
    s = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4,
                                  echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == e.choices[0].text
    ids = client.completions.create(model=model, prompt=[504, 3575, 282], temperature=0, max_tokens=2, echo=True)
    assert len(ids.choices[0].text) > 0
    expect_error_completion("echo", echo=True, logprobs=1)
    expect_error_completion("suffix", suffix=" the end")
    expect_error_completion("best_of", best_of=2)
    # The model by id; tokenize and detokenize (SGLang's endpoints) round-trip.
    assert client.models.retrieve(model).id == model
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("retrieve of an unknown model succeeded")
    except openai.NotFoundError as e:
        assert e.param == "model", e
    root = base.rsplit("/v1", 1)[0]
    http, auth = client._client, {"Authorization": f"Bearer {client.api_key}"}
    ids = http.post(root + "/tokenize", json={"prompt": "The capital of France"}, headers=auth).json()
    assert ids["count"] == len(ids["tokens"]) > 0, ids
    text = http.post(root + "/detokenize", json={"tokens": ids["tokens"]}, headers=auth).json()["text"]
    assert text.endswith("The capital of France"), text


def check_embeddings():
    """Embeddings (the package asks for base64 by default): identical inputs give equal unit
    vectors, different inputs different ones; the float encoding gives the same numbers."""
    texts = ["The capital of France", "The capital of France", "A story about a dragon"]
    r = client.embeddings.create(model=model, input=texts)
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > 0, r
    assert vecs[0] == vecs[1] and vecs[0] != vecs[2]
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vecs)
    floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float").data[0].embedding
    assert max(abs(a - b) for a, b in zip(floats, vecs[0])) < 1e-6
    for bad in [dict(input=""), dict(input=texts[0], dimensions=3)]:
        try:
            client.embeddings.create(model=model, **bad)
        except openai.BadRequestError as e:
            assert e.param in ("input", "dimensions"), e
            continue
        raise AssertionError(f"no 400 for {bad}")


def check_structured():
    """Output formats through the package's own helpers: 50 answers parsed into a pydantic model
    (nested object, enum, bounded list and numbers), 50 matching a regular expression."""
    import re
    from enum import Enum
    from typing import List

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        green = "green"
        blue = "blue"

    class Address(BaseModel):
        city: str = Field(max_length=24)
        zip: int = Field(ge=10000, le=99999)

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)
        favorite: Color
        address: Address
        hobbies: List[str] = Field(max_length=3)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    ask = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
    parsed = []
    for seed in range(10):
        r = parse(model=model, messages=ask, response_format=Person, n=5, seed=seed, temperature=0.8, max_tokens=160)
        parsed += [c.message.parsed for c in r.choices]
    assert len(parsed) == 50 and all(isinstance(p, Person) for p in parsed), parsed
    assert len({p.model_dump_json() for p in parsed}) > 1
    rx = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    texts = []
    for seed in range(5):
        c = client.completions.create(model=model, prompt="Name and number:", n=10, seed=seed, max_tokens=24,
                                      temperature=1.0, extra_body={"regex": rx})
        texts += [ch.text for ch in c.choices]
    assert len(texts) == 50 and all(re.fullmatch(rx, t) for t in texts), texts


def streamed_calls(**kw):
    """A streamed answer's content, calls (put together from delta.tool_calls as OpenAI's
    documentation does) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chat(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_tools():
    """A tool-calling round trip through the package: tools -> tool_calls -> a `tool` message
    -> the final answer, streamed and not. SmolLM2's chat template takes no tools: the server
    tells the model about them in the system message and reads its calls back."""
    import json

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = chat(messages=ask, tools=[weather], tool_choice="required", parallel_tool_calls=False, temperature=0,
             max_tokens=60)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None and len(m.tool_calls) >= 1, r
    call = m.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_"), call
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and len(args["city"]) <= 20
    # Streamed: the same calls.
    content, calls, finish = streamed_calls(messages=ask, tools=[weather], tool_choice="required", temperature=0,
                                            parallel_tool_calls=False,
                                            max_tokens=60)
    assert finish == "tool_calls" and content == "", (content, finish)
    assert [(c["name"], c["arguments"]) for c in calls] == [(t.function.name, t.function.arguments) for t in m.tool_calls]
    # A named function, one call.
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(messages=ask, tools=[weather], tool_choice=named, parallel_tool_calls=False, temperature=0.7, seed=1,
             max_tokens=60)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"], r
    # The result goes back as a `tool` message; the model answers in text.
    history = ask + [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius."}]
    final = chat(messages=history, tools=[weather], tool_choice="none", temperature=0, max_tokens=40)
    text = final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None and text and final.choices[0].finish_reason in ("stop", "length")
    content, calls, finish = streamed_calls(messages=history, tools=[weather], tool_choice="none", temperature=0,
                                            max_tokens=40)
    assert content == text and calls == [] and finish == final.choices[0].finish_reason, (content, text)
    # The history with its tool turns reached the model: the prompt is longer than without them.
    plain = chat(messages=ask, temperature=0, max_tokens=1)
    assert final.usage.prompt_tokens > plain.usage.prompt_tokens + 20, (final.usage, plain.usage)
    # auto: whatever the model writes comes back as text or calls, never both lost.
    r = chat(messages=ask, tools=[weather], tool_choice="auto", temperature=0, max_tokens=60)
    c = r.choices[0]
    assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls), c
    assert c.message.content or c.message.tool_calls, c


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
    check_api(msgs)
    check_embeddings()
    check_structured()
    check_tools()
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
