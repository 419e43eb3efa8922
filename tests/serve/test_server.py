"""`llmstep serve` driven over loopback with the official openai client: the same tokens as llmstep.generate,
alone and 16 at once, streamed or not; bad requests refused naming the field; a full queue; a disconnect."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from serving import TIMEOUT, client, load_shipped, running_server, shared_server, wait_for

import llmstep

openai = pytest.importorskip("openai")
shipped = pytest.fixture(scope="module", name="shipped")(load_shipped)
server = pytest.fixture(scope="module", name="server")(shared_server)

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "To be, or not to be", "KING HENRY:", "First Citizen:\nBefore we",
           "MACBETH: Is this a dagger", "HAMLET:", "O, what a rogue", "Now is the winter", "Friends, Romans",
           "LEAR: Blow, winds", "PORTIA: The quality", "Out, damned spot", "All the world", "Shall I compare",
           "If music be the food"]
NEW = 10


@pytest.fixture(scope="module")
def expected(shipped):
    model, tokenizer = shipped
    return {p: llmstep.generate(model, tokenizer, p, max_new_tokens=NEW, temperature=0) for p in PROMPTS}


def test_models_and_health(server):
    url, _ = server
    assert [m.id for m in client(url).models.list().data] == ["shipped"]
    health = httpx.get(f"{url}/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["kv_blocks_used"] == 0


def test_greedy_completions_are_generates_tokens(server, expected, shipped):
    url, _ = server
    for prompt in PROMPTS[:4]:
        r = client(url).completions.create(model="shipped", prompt=prompt, max_tokens=NEW, temperature=0)
        g = expected[prompt]
        assert r.choices[0].text == g.text
        assert r.usage.completion_tokens == len(g.tokens) and r.usage.prompt_tokens == len(g.prompt_ids)
        assert r.choices[0].finish_reason == "length"
    tokens = client(url).completions.create(model="shipped", prompt=expected[PROMPTS[0]].prompt_ids, max_tokens=NEW,
                                            temperature=0)  # the prompt as token ids
    assert tokens.choices[0].text == expected[PROMPTS[0]].text


def test_sixteen_concurrent_requests_get_generates_tokens_in_a_shared_batch(server, expected):
    url, engine = server
    c = client(url)

    def ask(prompt):
        return c.completions.create(model="shipped", prompt=prompt, max_tokens=NEW, temperature=0)

    start = time.perf_counter()
    for prompt in PROMPTS[:4]:
        ask(prompt)
    one_by_one = (time.perf_counter() - start) * len(PROMPTS) / 4  # four timed, as a rate for sixteen
    steps_before, start = engine.stats["steps"], time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    together = time.perf_counter() - start
    assert [a.choices[0].text for a in answers] == [expected[p].text for p in PROMPTS]
    tokens = sum(a.usage.completion_tokens for a in answers)
    # One engine step makes a token for every running request: far fewer steps than tokens means they shared.
    assert engine.stats["steps"] - steps_before < tokens / 2
    # Recorded, not asserted: on a shared 2-core machine wall time is noise; the step count above is the proof.
    print(f"16 requests: {together:.2f} s together, {one_by_one:.2f} s one after another (from 4), "
          f"{engine.stats['steps'] - steps_before} engine steps for {tokens} tokens")


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_the_whole_answer(server, chat):
    url, _ = server
    c = client(url)
    kw = dict(model="shipped", max_tokens=24, temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 50})
    if chat:
        kw["messages"] = [{"role": "user", "content": "Speak, my lord."}]
        whole = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content
    else:
        kw["prompt"] = "ROMEO:"
        whole = c.completions.create(**kw)
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == whole.choices[0].text
    finished = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finished == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for ch in chunks if ch.choices and (ch.choices[0].text if not chat else True)) >= 2  # in pieces


def test_a_seeded_sample_is_generates_sample(server, shipped):
    url, _ = server
    model, tokenizer = shipped
    g = llmstep.generate(model, tokenizer, "ROMEO:", max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=3)
    r = client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=16, temperature=0.9, top_p=0.95,
                                       seed=3, extra_body={"top_k": 40})
    assert r.choices[0].text == g.text


def test_a_repeated_long_prompt_hits_the_prefix_cache_with_the_same_answer(server, shipped):
    url, engine = server
    model, tokenizer = shipped
    prompt = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
              "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n")
    assert len(tokenizer.encode(prompt)) > 2 * 16  # two full blocks of 16 positions at least
    g = llmstep.generate(model, tokenizer, prompt, max_new_tokens=6, temperature=0)
    hits = engine.session.stats["prefix_hit_tokens"]
    answers = [client(url).completions.create(model="shipped", prompt=prompt, max_tokens=6, temperature=0)
               for _ in range(2)]
    assert [a.choices[0].text for a in answers] == [g.text, g.text]
    assert engine.session.stats["prefix_hit_tokens"] - hits >= 2 * 16  # the second reused the first's blocks


def test_chat_uses_the_checkpoints_template(server, shipped):
    url, _ = server
    model, tokenizer = shipped
    messages = [{"role": "system", "content": "You are a player."}, {"role": "user", "content": "Who goes there?"}]
    g = llmstep.generate(model, tokenizer, messages, max_new_tokens=12, temperature=0)
    r = client(url).chat.completions.create(model="shipped", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == g.text and r.usage.prompt_tokens == len(g.prompt_ids)


def test_a_stop_string_cuts_the_text_streamed_or_not(server, expected):
    url, _ = server
    g = expected["ROMEO:"]
    stop = g.text[6:9]  # three characters from inside the greedy answer
    c = client(url)
    r = c.completions.create(model="shipped", prompt="ROMEO:", max_tokens=NEW, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == g.text[:g.text.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="shipped", prompt="ROMEO:", max_tokens=NEW, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_text_held_back_for_a_stop_string_that_never_comes_leaves_at_the_end(server, expected, stream):
    url, _ = server
    g = expected["ROMEO:"]
    never = g.text[-1] + "\u2603"  # begins as the answer ends: its last character waits for the snowman
    r = client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=NEW, temperature=0, stop=never,
                                       stream=stream)
    if stream:
        chunks = list(r)
        text, reason = "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == (g.text, "length")


def test_an_end_of_sequence_token_ends_the_answer_with_stop_as_in_generate(shipped, expected):
    """The shipped model seldom ends a text, so its 4th greedy token after "ROMEO:" is made the end-of-sequence
    token: generate and the server stop there alike, the token counted, its text not shown."""
    import copy

    model, tokenizer = shipped
    eos = expected["ROMEO:"].tokens[3]
    ending = copy.copy(model)  # its own generation_config: the end tokens every engine stops at
    ending.generation_config = model.generation_config | {"eos_token_id": [eos]}
    g = llmstep.generate(ending, tokenizer, "ROMEO:", max_new_tokens=NEW, temperature=0)
    assert g.stop_reason == "stop" and len(g.tokens) < NEW
    with running_server(ending, tokenizer, n_slots=2) as (url, _):
        for stream in (False, True):
            r = client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=NEW, temperature=0,
                                               stream=stream, stream_options={"include_usage": True} if stream
                                               else None)
            if stream:
                chunks = list(r)
                text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
                used = chunks[-1].usage.completion_tokens
            else:
                text, reason, used = r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
            assert (text, reason, used) == (g.text, "stop", len(g.tokens))


def test_a_model_that_declares_no_end_token_stops_at_its_tokenizers_as_in_generate(shipped, expected):
    """A checkpoint whose config.json and generation_config.json name no end token (some Hugging Face ones):
    generate stops at the tokenizer's end tokens, and so does the server (it ran past them)."""
    import copy
    import dataclasses

    model, tokenizer = shipped
    eos = expected["ROMEO:"].tokens[3]
    silent = copy.copy(model)
    silent.config = dataclasses.replace(model.config, eos_token_id=[])
    silent.generation_config = {k: v for k, v in model.generation_config.items() if k != "eos_token_id"}
    ending = copy.copy(tokenizer)
    ending.eos_ids = [eos]
    g = llmstep.generate(silent, ending, "ROMEO:", max_new_tokens=NEW, temperature=0)
    assert g.stop_reason == "stop" and len(g.tokens) == 4
    with running_server(silent, ending, n_slots=2) as (url, _):
        r = client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=NEW, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (g.text, "stop", 4)


BAD = [  # (body fields, the field named)
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"seed": "x"}, "seed"),
    ({"seed": -1}, "seed"),  # the engine's range, 0 .. 2**64 - 1
    ({"n": 2}, "n"),
    ({"n": True}, "n"),  # not 1, though Python says True == 1
    ({"min_p": 0.1}, "min_p"),  # a sampling field llmstep does not do: refused, not ignored
    ({"logprobs": 3}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[f"{p}={v}" for (f, p) in BAD for v in [f[next(iter(f))]]])
def test_a_bad_completion_request_is_a_400_naming_the_field(server, fields, param):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as caught:  # extra_body: sent as given, past the client's own types
        client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=4, extra_body=fields)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"} and param in error["message"]


@pytest.mark.parametrize(("messages", "param"), [([], "messages"), ([{"role": "king", "content": "hi"}],
                                                                     "messages[0].role"),
                                                  ([{"role": "user", "content": 3}], "messages[0].content")])
def test_a_bad_chat_request_is_a_400_naming_the_field(server, messages, param):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(model="shipped", messages=messages, max_tokens=4)
    assert caught.value.body["param"] == param


def test_an_unknown_model_is_a_404_and_a_body_that_is_not_json_a_400(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as caught:
        client(url).completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model"
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "line 1 column 2" in r.json()["error"]["message"]  # where the parser stopped
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a\nb"}', timeout=TIMEOUT)  # a raw newline
    assert r.json()["error"]["message"] == ("the request body is not valid JSON: Invalid control character at line 1 "
                                            "column 14")  # Python's message ends in "at": not said twice
    r = httpx.post(f"{url}/v1/completions", content=b"[" * 5000 + b"]" * 5000, timeout=TIMEOUT)  # valid, too deep
    assert r.status_code == 400 and "too deeply" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi", "seed": ' + b"1" * 5000 + b"}",
                   timeout=TIMEOUT)  # valid JSON; Python's parser refuses an integer of more than 4,300 digits
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{url}/v1/models/shipped", timeout=TIMEOUT).json()["id"] == "shipped"  # models.retrieve
    assert client(url).models.retrieve("shipped").id == "shipped"
    r = httpx.get(f"{url}/v1/models/gpt-9", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_full_queue_answers_429_at_once_and_the_others_go_on(shipped):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=1, max_queue=1) as (url, engine):
        c = client(url)
        streams = [c.completions.create(model="shipped", prompt="ROMEO:", max_tokens=400, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}) for _ in range(2)]
        wait_for(lambda: engine.health()["running"] + engine.health()["waiting"] == 2, "two requests in")
        with pytest.raises(openai.RateLimitError) as caught:
            c.completions.create(model="shipped", prompt="hi", max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
        assert caught.value.response.headers["Retry-After"] == "1"  # when a client may ask again
        assert engine.stats["refused"] == 1
        for s in streams:
            s.close()  # both go: the server takes requests again
        wait_for(lambda: engine.health()["running"] + engine.health()["waiting"] == 0, "the streams dropped")
        assert c.completions.create(model="shipped", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_client_gone_mid_stream_frees_its_blocks_and_the_others_go_on(shipped, expected):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=4) as (url, engine):
        c = client(url)
        body = {"model": "shipped", "prompt": "ROMEO:", "max_tokens": 400, "stream": True, "ignore_eos": True,
                "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                other = pool.submit(c.completions.create, model="shipped", prompt="JULIET: O Romeo, Romeo",
                                    max_tokens=NEW, temperature=0)
                wait_for(lambda: engine.health()["running"] == 2, "the second request to join")
            answer = other.result(TIMEOUT)  # the stream is closed: the other request still gets its tokens
        assert answer.choices[0].text == expected["JULIET: O Romeo, Romeo"].text
        wait_for(lambda: engine.health()["running"] == 0, "the dropped stream to leave")
        health = engine.health()
        assert health["cancelled"] == 1 and health["kv_blocks_used"] == 0
        assert health["tokens"] < 400  # it left long before its 400 tokens


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_slot(shipped):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=2) as (url, engine):
        step = engine.session.step  # 10 ms more a step: 400 tokens outlast the 2 s wait on any machine
        engine.session.step = lambda: time.sleep(0.01) or step()
        body = {"model": "shipped", "prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # gives up after 2 s: the connection closes
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=2.0))
        wait_for(lambda: engine.health()["running"] == 0, "the abandoned request to leave")
        health = engine.health()
        assert health["cancelled"] == 1 and health["kv_blocks_used"] == 0 and health["tokens"] < 400
