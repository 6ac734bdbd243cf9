"""An agent's tokenizer on the controller (tokens.py): what the engine can take, read from
the model; a prompt that cannot fit refused before it is tokenized; an empty one refused."""

import json

import pytest
from openai_fakes import ScriptedEngine, build_tokenizer

from flexmarl.controller.episodes.tokens import AgentTokenizer, PromptTooLong, model_context, text_size
from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext
from flexmarl.controller.state.store import ExperienceStore


def test_the_context_is_the_models_own_unless_the_config_says_and_text_is_counted_by_its_contents(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert model_context(str(tmp_path)) == 2048
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"n_positions": 512}}))
    assert model_context(str(tmp_path)) == 512
    assert model_context(str(tmp_path / "nowhere")) == 0
    assert text_size([{"role": "user", "content": "abc"}, {"role": "user", "content": [
        {"type": "text", "text": "de"}, {"type": "image_url"}]}, {"role": "assistant"}]) == 5


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized_and_an_empty_one_at_all(tmp_path):
    tok = AgentTokenizer("solver", build_tokenizer(tmp_path), context=64)
    store = ExperienceStore(["solver"])
    engine = ScriptedEngine(tok, ["It is 42."] * 2)
    ctx = EpisodeContext("e0", 1, None, store, engine, {"solver": AgentDefaults(8, 1.0, 2)}, run_seed=1,
                         tokenizers={"solver": tok})
    tokenized = []
    real = tok.encode
    tok.encode = lambda text: tokenized.append(len(text)) or real(text)
    with pytest.raises(PromptTooLong, match=r"the prompt is at least \d+ tokens \(3000000 characters\); agent "
                                            r"solver takes at most 56 here"):
        await ctx.generate("solver", "7 " * 1_500_000)
    assert tokenized == []  # refused on its size alone
    with pytest.raises(PromptTooLong, match="the prompt is 60 tokens; agent solver takes at most 56 here"):
        await ctx.generate("solver", list(range(3, 63)))
    with pytest.raises(ValueError, match="the prompt is empty"):
        await ctx.generate("solver", [])
    assert engine.requests == []
    assert len(await ctx.generate("solver", "What is 12 + 30?")) == 2 and tokenized[0] == 16  # (then the replies)
