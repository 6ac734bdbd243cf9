"""Calls of the OpenAI API as turns of an episode, through the real endpoint (HTTP on
loopback, the real `openai` client) in front of an engine that answers with scripted ids:
a call without `n` is a group, a continued conversation keeps the engine's own ids,
rewards go by completion id or to every sample of an agent, and what is left unrewarded
is named by its completion."""

import asyncio

import pytest
from openai_fakes import QUESTION, ScriptedEngine, make_context, running_endpoint, tok  # noqa: F401 (a fixture)

from flexmarl.controller.episodes.workflow import run_episode


async def test_a_call_without_n_is_one_group_of_the_agents_group_size_and_with_n_of_that_size(tok):
    engine = ScriptedEngine(tok, ["It is 42."] * 5)
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok, group_size=2)
        client = ctx.openai_client()
        first = await client.chat.completions.create(model="solver", messages=QUESTION)
        second = await client.chat.completions.create(model="solver", messages=QUESTION, n=3)
        assert [c.index for c in first.choices] == [0, 1] and len(second.choices) == 3
        assert first.choices[0].message.content == "It is 42." and first.choices[0].finish_reason == "stop"
        samples = ctx.samples("solver")
        assert [s.key for s in samples] == [samples[0].key] * 2 + [samples[2].key] * 3  # a group of 2, one of 3
        ctx.reward(first.id, [1.0, 0.0])
        ctx.reward_all("solver", 0.5)
        assert all(s.status == "ready" for s in samples)
        await ctx.end()


async def test_a_continued_conversation_keeps_the_engines_own_ids_for_the_earlier_reply(tok):
    # The engine wrote "It is 42." one byte-level token per character: not how the
    # tokenizer would encode that text, so a re-tokenized history would differ.
    own = [tok.tok.convert_tokens_to_ids(c) for c in tok.tok.convert_ids_to_tokens(tok.encode("It is 42."))
           for c in c] + [tok.eos_token_id]
    assert own[:-1] != tok.encode("It is 42.") and tok.decode(own) == "It is 42."
    engine = ScriptedEngine(tok, [own, own, "The answer is 12."])
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        first = await client.chat.completions.create(model="solver", messages=QUESTION)
        reply = {"role": "assistant", "content": first.choices[1].message.content}
        later = await client.chat.completions.create(
            model="solver", messages=QUESTION + [reply, {"role": "user", "content": "Try again."}],
            extra_body={"return_token_ids": True}, logprobs=True)
        samples = ctx.samples("solver")
        assert len(samples) == 2 and later.choices[0].message.content == "The answer is 12."
        continued = samples[0]  # the two choices said the same: the first of them goes on
        appended = tok.chat_delta(QUESTION + [reply], QUESTION + [reply, {"role": "user", "content": "Try again."}],
                                  True)
        assert continued.output_ids.tolist() == own + appended + engine.ids("The answer is 12.")
        assert continued.mask.tolist() == [1] * len(own) + [0] * len(appended) + [1] * len(engine.ids("The answer is 12."))
        assert later.prompt_token_ids == continued.prompt_ids.tolist() + own + appended
        assert later.choices[0].token_ids == engine.ids("The answer is 12.")
        assert [t.logprob for t in later.choices[0].logprobs.content] == [-0.25] * len(later.choices[0].token_ids)
        assert engine.requests[-1].prompt_ids == later.prompt_token_ids  # what the engine was asked to continue
        assert len(continued.versions) == 2 and samples[1].output_ids.tolist() == own  # the other choice stays one turn
        await ctx.end()


async def test_two_equal_choices_are_continued_one_each_even_at_once_and_a_call_extending_neither_is_a_new_group(tok):
    engine = ScriptedEngine(tok, ["It is 42."] * 2 + ["Try again."] * 2 + ["It is 42."] * 2)
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        first = await client.chat.completions.create(model="solver", messages=QUESTION)
        follow = QUESTION + [{"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "Sure?"}]
        a, b = await asyncio.gather(client.chat.completions.create(model="solver", messages=follow),
                                    client.chat.completions.create(model="solver", messages=follow))
        assert len(a.choices) == len(b.choices) == 1
        s0, s1 = ctx.samples("solver")
        assert len(s0.versions) == len(s1.versions) == 2 and s0.text == s1.text == "Try again."
        fresh = await client.chat.completions.create(
            model="solver", messages=QUESTION + [{"role": "assistant", "content": "It is 41."}])  # said by no sample
        assert len(fresh.choices) == 2 and len({s.key for s in ctx.samples("solver")}) == 2
        ctx.reward(a.id, 1.0)
        ctx.reward(b.id, 0.0)
        ctx.reward_all("solver", lambda s: float("42" in s.text))
        rewards = [s.reward for s in ctx.samples("solver")]
        assert sorted(rewards[:2]) == [0.0, 1.0] and rewards[2:] == [1.0, 1.0]
        with pytest.raises(ValueError, match="has 2 choices"):
            ctx.reward(first.id, 1.0)
        await ctx.end()


async def test_an_episode_ending_with_unrewarded_samples_fails_naming_their_completions(tok):
    engine = ScriptedEngine(tok, ["It is 42."] * 3)

    async def episode(ctx):
        client = ctx.openai_client()
        await client.chat.completions.create(model="solver", messages=QUESTION, n=3)

    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        why = await run_episode(episode, ctx, 30)
    assert "ended without rewarding every sample of ['solver chatcmpl-e0-0 (choices 0, 1, 2)']" in why
    assert all(s.status == "dropped" for s in ctx.samples("solver"))


async def test_an_ended_episodes_key_names_nothing(tok):
    import openai

    engine = ScriptedEngine(tok, ["It is 42."] * 2)
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        key = ctx.openai_api_key
        assert key.endswith("-e0") and ctx.openai_base_url == endpoint.base_url
        await ctx.end()
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="no live episode has this API key"):
            await client.chat.completions.create(model="solver", messages=QUESTION)
        await client.close()
    assert engine.requests == []


async def test_calls_from_concurrent_branches_open_the_groups_ctx_chat_would_open_there(tok):
    """The group ids (and with them the sampling seeds) follow the calling branch's place
    in the workflow, whatever the order the calls reach the endpoint in."""

    async def by_chat(ctx):
        async def branch(delay):
            await asyncio.sleep(delay)
            return await ctx.chat("solver", QUESTION)
        await asyncio.gather(branch(0.2), branch(0.0))
        ctx.reward_all("solver", 1.0)

    async def by_endpoint(ctx):
        client = ctx.openai_client()

        async def branch(delay):
            await asyncio.sleep(delay)
            return await client.chat.completions.create(model="solver", messages=QUESTION)
        await asyncio.gather(branch(0.2), branch(0.0))
        ctx.reward_all("solver", 1.0)

    async with running_endpoint() as endpoint:
        ids = []
        for episode in (by_chat, by_endpoint):
            engine = ScriptedEngine(tok, ["It is 42."] * 4)
            ctx = make_context(endpoint, engine, tok)
            assert await run_episode(episode, ctx, 30) == ""
            ids.append([(r.sample_id, r.seed) for r in engine.requests])
    assert ids[0] == ids[1] and len(set(ids[0])) == 4


async def test_tool_calls_are_parsed_by_the_agents_vllm_tool_parser_and_the_tool_result_continues_the_sample(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    engine = ScriptedEngine(tok, [call, call, "The tool says 42."])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    async with running_endpoint(parsers={"solver": "hermes"}) as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        first = await client.chat.completions.create(model="solver", messages=QUESTION, tools=tools)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "add"
        assert choice.message.tool_calls[0].function.arguments == '{"a": 12, "b": 30}'
        # The client sends the call back as structured tool_calls, then the tool's result.
        back = choice.message.model_dump(exclude_none=True)
        answer = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "42"}
        final = await client.chat.completions.create(model="solver", messages=QUESTION + [back, answer], tools=tools)
        assert final.choices[0].message.content == "The tool says 42." and len(final.choices) == 1
        sample = ctx.samples("solver")[0]
        assert sample.output_ids[:len(engine.ids(call))].tolist() == engine.ids(call)  # the engine's ids, as drawn
        assert tok.tok.decode(sample.output_ids.tolist()).endswith("<|tool|>42<eos><|assistant|>The tool says 42.<eos>")
        ctx.reward_all("solver", 1.0)
        await ctx.end()


async def test_text_completions_open_groups_and_continue_a_sample_with_the_engines_ids(tok):
    engine = ScriptedEngine(tok, ["It is 42."] * 2 + ["Try again."])
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok)
        client = ctx.openai_client()
        first = await client.completions.create(model="solver", prompt="What is 12 + 30?")
        assert [c.text for c in first.choices] == ["It is 42."] * 2
        prompt = tok.encode("What is 12 + 30?") + engine.ids("It is 42.") + tok.encode(" Sure?")
        more = await client.completions.create(model="solver", prompt=prompt, logprobs=1)
        assert more.choices[0].text == "Try again." and more.choices[0].logprobs.token_logprobs[0] == -0.25
        sample = ctx.samples("solver")[0]
        assert sample.output_ids.tolist() == engine.ids("It is 42.") + tok.encode(" Sure?") + engine.ids("Try again.")
        ctx.reward(first.id, [1.0, 0.0])
        await ctx.end()


async def test_without_the_endpoint_the_context_says_how_to_turn_it_on(tok):
    ctx = make_context(None, ScriptedEngine(tok, []), tok)
    with pytest.raises(RuntimeError, match="openai.enabled = true"):
        ctx.openai_client()


async def test_an_evaluation_episode_calls_the_same_endpoint_for_one_sample_at_its_own_temperature(tok):
    engine = ScriptedEngine(tok, ["It is 42.", "Try again."])
    async with running_endpoint() as endpoint:
        ctx = make_context(endpoint, engine, tok, eval_temperature=0.0)
        client = ctx.openai_client()
        first = await client.chat.completions.create(model="solver", messages=QUESTION, temperature=1.0)
        said = {"role": "assistant", "content": first.choices[0].message.content}
        again = await client.chat.completions.create(
            model="solver", messages=QUESTION + [said, {"role": "user", "content": "Sure?"}])
        assert len(first.choices) == len(again.choices) == 1
        assert [r.temperature for r in engine.requests] == [0.0, 0.0]
        (sample,) = ctx.samples("solver")
        assert len(sample.versions) == 2
        ctx.reward(again.id, 1.0)
        await ctx.end()
