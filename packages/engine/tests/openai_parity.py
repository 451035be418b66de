"""One OpenAI parity suite for every place we serve: `edge-infer serve` on the host
(test_serve.py) and the engine image (docker/tests). Each check drives one parameter we accept
through the openai client, asserts what OpenAI's API promises for it, and ends with a liveness
request, so a parameter that kills the engine fails its own check, not the next one.

Only the openai client and the standard library: the image tests install nothing else.
"""

from __future__ import annotations

import json

import openai

PROMPT = "The capital of France is"


def alive(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=2, temperature=0)
    assert out.choices[0].text, "the server answered nothing after the check"


def logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, logprobs=3,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs), lp.token_logprobs
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs), lp.top_logprobs


def chat_top_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
        logprobs=True, top_logprobs=2, temperature=0)
    content = out.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content), content


def prompt_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                    extra_body={"prompt_logprobs": 1})
    rows = out.choices[0].model_extra["prompt_logprobs"]
    # one row per prompt token, the first (no context) None
    assert rows[0] is None and len(rows) >= 3 and all(r for r in rows[1:]), rows


def echo(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, echo=True,
                                    temperature=0)
    assert out.choices[0].text.startswith(PROMPT), out.choices[0].text


def n_choices(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=3,
                                    temperature=1.0, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]


def seed(client, model):
    texts = {client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                       seed=1234).choices[0].text for _ in range(2)}
    assert len(texts) == 1, f"the same seed sampled different texts: {texts}"


def stop(client, model):
    out = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16,
                                    temperature=0, stop=[","])
    assert "," not in out.choices[0].text and out.choices[0].finish_reason == "stop", out


def sampling_params(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9,
        frequency_penalty=0.5, presence_penalty=0.5, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert out.usage.completion_tokens >= 1


def logit_bias(client, model):
    forced = 100  # any token id: +100 makes it the only candidate
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100}, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    tokens = out.choices[0].logprobs.tokens
    assert tokens == [f"token_id:{forced}"] * 3, f"logit_bias +100 did not force the token: {tokens}"


def json_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a city as JSON."}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema}})
    data = json.loads(out.choices[0].message.content)
    assert set(data) == {"city"} and isinstance(data["city"], str), data


def choice(client, model):
    out = client.completions.create(model=model, prompt="Is water wet? Answer:", max_tokens=4,
                                    temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no"), out.choices[0].text


def stream_usage(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1, chunks[-1]
    assert all(c.usage is None for c in chunks[:-1])


def cancel(client, model):
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=200, stream=True,
                                       temperature=0)
    next(iter(stream))
    stream.close()  # the client hangs up mid-stream; the server must carry on


CHECKS = {f.__name__: f for f in (
    logprobs, chat_top_logprobs, prompt_logprobs, echo, n_choices, seed, stop, sampling_params,
    logit_bias, json_schema, choice, stream_usage, cancel)}


def run(name: str, client: openai.OpenAI, model: str) -> None:
    CHECKS[name](client, model)
    alive(client, model)


# Bad input, sent raw (the openai client would refuse some of it): each is a 4xx with a message,
# and the server answers a normal request afterwards.
def bad_inputs(model: str) -> dict[str, tuple[str, bytes]]:
    def body(**fields) -> bytes:
        return json.dumps({"model": model, **fields}).encode()

    completions, chat = "/v1/completions", "/v1/chat/completions"
    return {
        "malformed json": (completions, b'{"model": "%s", "prompt": ' % model.encode()),
        "wrong type": (completions, body(prompt="hi", max_tokens="many")),
        "max_tokens 0": (completions, body(prompt="hi", max_tokens=0)),
        "max_tokens negative": (completions, body(prompt="hi", max_tokens=-5)),
        "longer than context": (completions, body(prompt="word " * 3000, max_tokens=4)),
        "unknown model": (completions, json.dumps({"model": "gpt-9", "prompt": "hi",
                                                   "max_tokens": 4}).encode()),
        "1 MB prompt": (completions, body(prompt="x" * (1 << 20), max_tokens=4)),
        "messages not a list": (chat, body(messages="hi")),
        "unknown chat role": (chat, body(messages=[{"role": "user", "content": "hi"},
                                                   {"role": "wizard", "content": "hi"}])),
    }


BAD_CASES = sorted(bad_inputs("m"))


def request(base: str, path: str, body: bytes | None, key: str | None) -> tuple[int, dict]:
    """(status, JSON body) of one raw request; GET when there is no body."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, data=body, headers=headers,
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"text": raw.decode(errors="replace")}


def bad_input(case: str, base: str, key: str | None, client: openai.OpenAI, model: str) -> None:
    path, body = bad_inputs(model)[case]
    status, answer = request(base, path, body, key)
    assert 400 <= status < 500, (status, answer)
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    assert message, answer
    if case == "unknown chat role":  # as OpenAI's API answers it, naming the message
        assert status == 400 and "messages[1].role: 'wizard' is not a chat role" in message, answer
    alive(client, model)


def key_required(base: str, key: str, model: str) -> None:
    """Without the key (or with a wrong one) every route but /health and /ping is a 401, the
    routes vLLM's own --api-key leaves open included."""
    probes = [("/v1/models", None), ("/metrics", None), ("/version", None), ("/load", None),
              ("/tokenize", json.dumps({"model": model, "prompt": "hi"}).encode()),
              ("/invocations", json.dumps({"model": model, "prompt": "hi",
                                           "max_tokens": 1}).encode())]
    for wrong in (None, key + "-wrong"):
        for path, body in probes:
            status, answer = request(base, path, body, wrong)
            assert status == 401 and answer.get("error"), (path, status, answer)
        for path in ("/health", "/ping"):
            assert request(base, path, None, wrong)[0] == 200, path
    assert request(base, "/tokenize", probes[4][1], key)[0] == 200
