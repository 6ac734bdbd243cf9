"""The OpenAI endpoint's errors and its other answers, as OpenAI clients expect them: an
unknown model lists the agents, a key of no live episode is 401, a bad field is 400 naming
it, and no malformed request reaches the engine or stops the endpoint."""

import asyncio
import json

import httpx
import openai
import pytest
from openai_fakes import QUESTION, ScriptedEngine, make_context, running_endpoint, tok  # noqa: F401 (a fixture)

from flexmarl.controller.rollout.router import RequestRefused
from flexmarl.controller.serving.openai_api import OpenAIEndpoint
from flexmarl.runtime.config import ConfigError, OpenAIConfig


async def test_bad_requests_get_the_openai_error_shape_and_never_reach_the_engine(tok):
    engine = ScriptedEngine(tok, ["It is 42."] * 2)
    async with running_endpoint(max_request_bytes=4096) as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        with pytest.raises(openai.NotFoundError, match="'solvr' is not an agent of this run.*one of solver") as err:
            await client.chat.completions.create(model="solvr", messages=QUESTION)
        assert err.value.body["param"] == "model" and err.value.status_code == 404
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="solver", messages=QUESTION, temperature="hot")
        assert err.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="solver", messages="What is 12 + 30?")
        assert err.value.body["param"] == "messages"
        with pytest.raises(openai.BadRequestError, match="logit_bias is not supported here") as err:
            await client.chat.completions.create(model="solver", messages=QUESTION, logit_bias={"5": 10})
        assert err.value.body["param"] == "logit_bias"
        with pytest.raises(openai.BadRequestError, match="the sampled token's logprob only") as err:
            await client.chat.completions.create(model="solver", messages=QUESTION, logprobs=True, top_logprobs=3)
        assert err.value.body["param"] == "top_logprobs"
        with pytest.raises(openai.BadRequestError, match="the sampled token's logprob only") as err:
            await client.completions.create(model="solver", prompt="What is 12 + 30?", logprobs=5)
        assert err.value.body["param"] == "logprobs"
        with pytest.raises(openai.BadRequestError, match="tool_choice may be 'auto' or 'none'"):
            await client.chat.completions.create(model="solver", messages=QUESTION, tool_choice="required", tools=[
                {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
        with pytest.raises(openai.BadRequestError, match="content parts of type 'image_url'"):
            await client.chat.completions.create(model="solver", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
        headers = {"authorization": f"Bearer {ctx.openai_api_key}", "content-type": "application/json"}
        async with httpx.AsyncClient(base_url=endpoint.base_url) as raw:
            bad = await raw.post("/chat/completions", content=b'{"model": "solver", "messages": [', headers=headers)
            assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
            big = await raw.post("/chat/completions", headers=headers,
                                 content=json.dumps({"model": "solver", "messages": QUESTION, "user": "x" * 5000}))
            assert big.status_code == 413 and big.json()["error"]["code"] == 413
            nokey = await raw.post("/chat/completions", json={"model": "solver", "messages": QUESTION})
            assert nokey.status_code == 401 and set(nokey.json()["error"]) >= {"message", "type", "param", "code"}
        assert engine.requests == []
        answer = await client.chat.completions.create(model="solver", messages=QUESTION)  # still serving
        assert answer.choices[0].message.content == "It is 42."
        ctx.reward_all("solver", 1.0)
        await ctx.end()


async def test_a_call_the_engine_refuses_fails_alone_and_a_continuation_takes_one_reply(tok):
    engine = ScriptedEngine(tok, [RequestRefused("solver on rollout-0 refused e0/x/0: the prompt is too long"),
                                  "It is 42.", "It is 42."])
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        with pytest.raises(openai.BadRequestError, match="the prompt is too long"):
            await client.chat.completions.create(model="solver", messages=QUESTION)
        assert [s.status for s in ctx.samples("solver")] == ["dropped"] * 2  # the refused call's group: nothing to reward
        first = await client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "Try again."}])
        follow = [{"role": "user", "content": "Try again."}, {"role": "assistant", "content": "It is 42."},
                  {"role": "user", "content": "Sure?"}]
        with pytest.raises(openai.BadRequestError, match="continues a conversation takes one reply") as err:
            await client.chat.completions.create(model="solver", messages=follow, n=2)
        assert err.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError, match="a group needs at least 2 samples"):
            await client.chat.completions.create(model="solver", messages=QUESTION, n=1)
        ctx.reward(first.id, [1.0, 0.0])
        await ctx.end()


async def test_stream_answers_the_whole_reply_as_server_sent_events(tok):
    engine = ScriptedEngine(tok, ["It is 42.", "Try again."])
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        stream = await client.chat.completions.create(model="solver", messages=QUESTION, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert [(c.choices[0].index, c.choices[0].delta.content, c.choices[0].finish_reason)
                for c in chunks if c.choices] == [(0, "It is 42.", "stop"), (1, "Try again.", "stop")]
        assert chunks[-1].usage.completion_tokens == len(engine.ids("It is 42.")) + len(engine.ids("Try again."))
        ctx.reward_all("solver", 0.0)
        await ctx.end()


async def test_the_episodes_client_is_answered_in_its_own_task_as_an_http_client_is_over_the_socket(tok):
    engine = ScriptedEngine(tok, ["It is 42.", "Try again."] * 2)
    tasks = []
    answer = engine.generate

    async def generate(agent, requests):
        tasks.append(asyncio.current_task())
        return await answer(agent, requests)

    engine.generate = generate
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        inside = await ctx.openai_client().chat.completions.create(model="solver", messages=QUESTION, stream=True)
        inside = [c.choices[0].delta.content async for c in inside if c.choices]
        assert tasks == [asyncio.current_task()]  # no socket, no server task between them
        over_http = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=ctx.openai_api_key, max_retries=0)
        outside = await over_http.chat.completions.create(model="solver", messages=QUESTION, stream=True)
        assert [c.choices[0].delta.content async for c in outside if c.choices] == inside == ["It is 42.", "Try again."]
        assert tasks[1] is not tasks[0]  # the server's own task answered that one
        with pytest.raises(openai.NotFoundError, match="'solvr' is not an agent"):
            await ctx.openai_client().chat.completions.create(model="solvr", messages=QUESTION)
        with pytest.raises(openai.NotFoundError, match="'solvr' is not an agent"):
            await over_http.chat.completions.create(model="solvr", messages=QUESTION)
        await over_http.close()
        ctx.reward_all("solver", 0.0)
        await ctx.end()


async def test_models_lists_the_agents_to_a_live_key_and_nothing_to_another(tok):
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, ScriptedEngine(tok, []), tok)
        models = await ctx.openai_client().models.list()
        assert [m.id for m in models.data] == ["solver"]
        stranger = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="sk-nothing", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
        await stranger.close()
        await ctx.end()


def test_an_endpoint_off_loopback_needs_a_key_and_a_tool_parser_must_be_vllms(monkeypatch):
    monkeypatch.delenv("FLEXMARL_OPENAI_KEY", raising=False)
    with pytest.raises(ConfigError, match="not loopback.*FLEXMARL_OPENAI_KEY"):
        OpenAIEndpoint(OpenAIConfig(enabled=True, host="0.0.0.0"), {"solver": "m"})
    monkeypatch.setenv("FLEXMARL_OPENAI_KEY", "sk-team")
    endpoint = OpenAIEndpoint(OpenAIConfig(enabled=True, host="0.0.0.0"), {"solver": "m"})
    assert endpoint.key == "sk-team"
    with pytest.raises(ConfigError, match="agents.solver.tool_parser = 'hermez' is not one of vLLM's tool parsers "
                                          r"\(.*hermes"):
        OpenAIEndpoint(OpenAIConfig(enabled=True), {"solver": "m"}, {"solver": "hermez"})


async def test_malformed_requests_are_each_a_4xx_in_the_openai_shape_and_nothing_reaches_the_engine(tok, caplog):
    engine = ScriptedEngine(tok, ["It is 42."] * 2)
    async with running_endpoint(max_n=8) as endpoint:
        ctx = make_context(endpoint, engine, tok)
        headers = {"authorization": f"Bearer {ctx.openai_api_key}", "content-type": "application/json"}
        deep = b'{"model": "solver", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        asked = {
            "n = 0": ("/chat/completions", json.dumps({"model": "solver", "messages": QUESTION, "n": 0}).encode()),
            "n = 1000": ("/chat/completions", json.dumps({"model": "solver", "messages": QUESTION, "n": 1000}).encode()),
            "an empty prompt": ("/completions", json.dumps({"model": "solver", "prompt": ""}).encode()),
            "no messages": ("/chat/completions", json.dumps({"model": "solver", "messages": []}).encode()),
            "JSON nested 100,000 deep": ("/chat/completions", deep),
        }
        async with httpx.AsyncClient(base_url=endpoint.base_url) as raw:
            answers = {what: await raw.post(path, content=body, headers=headers) for what, (path, body) in asked.items()}
        for what, answer in answers.items():
            assert answer.status_code == 400, (what, answer.text)
            assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}, what
        assert answers["n = 0"].json()["error"]["message"] == "n must be at least 1 (got 0)"
        assert "openai.max_n = 8" in answers["n = 1000"].json()["error"]["message"]
        assert answers["an empty prompt"].json()["error"]["param"] == "prompt"
        assert answers["JSON nested 100,000 deep"].json()["error"]["message"] == "the request body is nested too deeply"
        assert engine.requests == [] and "Traceback" not in caplog.text
        answer = await ctx.openai_client().chat.completions.create(model="solver", messages=QUESTION)
        assert answer.choices[0].message.content == "It is 42."  # still serving
        ctx.reward_all("solver", 1.0)
        await ctx.end()


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized_and_a_cap_in_tokens_holds(tok, monkeypatch):
    from flexmarl.controller.episodes.tokens import AgentTokenizer

    sized = AgentTokenizer("solver", tok.tok.name_or_path, context=64)
    engine = ScriptedEngine(sized, ["It is 42."] * 2)

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    async with running_endpoint(max_request_tokens=12) as endpoint:
        ctx = make_context(endpoint, engine, sized)
        client = ctx.openai_client()
        monkeypatch.setattr(sized, "chat_prompt", never)
        monkeypatch.setattr(sized, "encode", never)
        huge = [{"role": "user", "content": "7 " * 3_145_728}]  # 6 MiB: under the body cap
        with pytest.raises(openai.BadRequestError, match=r"the prompt is at least \d+ tokens \(6291456 characters\); "
                                                         r"agent solver takes at most 12 here"):
            await client.chat.completions.create(model="solver", messages=huge)
        with pytest.raises(openai.BadRequestError, match="takes at most 12 here"):
            await client.completions.create(model="solver", prompt="7 " * 3_145_728)
        monkeypatch.undo()
        with pytest.raises(openai.BadRequestError, match=r"the prompt is \d+ tokens; agent solver takes at most 12 here"):
            await client.chat.completions.create(model="solver", messages=[
                {"role": "user", "content": "What is 12 + 30? " * 4}])  # few characters, more tokens than the cap
        assert engine.requests == []
        answer = await client.chat.completions.create(model="solver", messages=QUESTION)
        assert answer.choices[0].message.content == "It is 42."
        ctx.reward_all("solver", 1.0)
        await ctx.end()


async def test_answers_carry_no_file_path_nor_exception_text_and_the_servers_401_names_its_key(tok, caplog):
    engine = ScriptedEngine(tok, [RuntimeError("cannot open /secret/run/model.safetensors")])
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="solver", messages=QUESTION)
        assert err.value.body["message"] == "the server failed to answer this call; its log says why"
        assert "/secret" in caplog.text and "Traceback" not in caplog.text  # the log says it, in one line
        models = await client.models.list()
        assert "models/solver" not in models.model_dump_json()  # where the agent's model is: never shown
        await ctx.end()
    served = OpenAIEndpoint(OpenAIConfig(enabled=True, key_env="SERVE_KEY_FOR_TEST"), {"solver": "/m"},
                            serving=lambda: None)
    served.key_required = True
    await served.start()
    try:
        async with httpx.AsyncClient(base_url=served.base_url) as raw:
            refused = await raw.get("/models", headers={"authorization": "Bearer sk-wrong"})
    finally:
        await served.stop()
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == ("this API key is not the server's: use the key in the environment "
                                                  "variable SERVE_KEY_FOR_TEST (openai.key_env) that the server was "
                                                  "started with")
