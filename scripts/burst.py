#!/usr/bin/env python3
"""A burst of concurrent chat requests against a running `engrun serve` (docs/server.md).

usage: burst.py BASE_URL MODEL [N] [MAX_TOKENS]

Sends N (default 200) chat requests at once with the official `openai` package (async), each
asking for MAX_TOKENS (default 8) tokens at temperature 0, and prints one JSON line: the time
to the first complete answer, the latency percentiles (p50, p90, p99, max) of all of them, and
the wall time, in seconds from the moment the burst was sent.
"""
import asyncio
import json
import sys
import time

from openai import AsyncOpenAI

base, model = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 8
client = AsyncOpenAI(base_url=base, api_key="burst", max_retries=0, timeout=600)
topics = ["the sea", "a city", "the moon", "a forest", "music", "rain", "a train", "bread", "snow", "time"]


async def one(i, t0):
    msgs = [{"role": "user", "content": f"Write one sentence about {topics[i % len(topics)]} (request {i})."}]
    r = await client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=max_tokens)
    assert r.choices[0].message.content is not None
    return time.monotonic() - t0


async def main():
    t0 = time.monotonic()
    lat = sorted(await asyncio.gather(*(one(i, t0) for i in range(n))))
    pct = lambda p: round(lat[min(len(lat) - 1, int(p / 100 * len(lat)))], 2)
    print(json.dumps({"requests": n, "max_tokens": max_tokens, "first_s": round(lat[0], 2), "p50_s": pct(50),
                      "p90_s": pct(90), "p99_s": pct(99), "max_s": round(lat[-1], 2), "wall_s": round(time.monotonic() - t0, 2)}))


asyncio.run(main())
