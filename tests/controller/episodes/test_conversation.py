"""Text, chat and multi-turn samples with a fake rollout side and a real tokenizer: the
ids are exactly what the engine produced, appended turns are masked out of the loss,
every turn records its version, and a conversation with a turn past the staleness bound
is never trained."""

import random

import pytest

from flexmarl.controller.episodes.tokens import AgentTokenizer
from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext
from flexmarl.controller.state import decisions
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import DROPPED, ExperienceStore
from flexmarl.runtime import protocol


def sent(ctx, store, sample):
    """What the trainer is sent of `sample`'s group (every member rewarded, the group trained)."""
    ctx.reward_all(sample.agent, 0.5)
    (mb,) = store.form_micro_batches(sample.agent, ctx.batch, decisions.MicroBatchSize(8), True, False, 9)
    (group,) = mb.wire()
    return group

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "hi", "what", "is", "two", "plus", "one",
         "three", "four", "wrong", "try", "again"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return str(out)


class ScriptedEngine:
    """Answers each request with the next scripted ids (as an engine would: ids, logprobs,
    the version of the weights that served it)."""

    def __init__(self, replies, version=0):
        self.replies, self.version, self.requests = list(replies), version, []

    async def generate(self, agent, group, after=""):
        self.requests.append(group)
        return output_of([self.replies.pop(0) for _ in range(group.n)], [[-0.5] * 2] * group.n, self.version,
                         finish_reason="stop")


def ctx_for(store, engine, tokenizer_dir, batch=1, gate=None):
    agents = {"solver": AgentDefaults(8, 1.0, 2)}
    return EpisodeContext("e0", batch, random.Random(0), store, engine, agents, run_seed=1, gate=gate,
                          tokenizers={"solver": AgentTokenizer("solver", tokenizer_dir)})


async def test_text_and_chat_prompts_use_the_agents_tokenizer_and_outputs_are_the_engines_ids(tokenizer_dir):
    tok = AgentTokenizer("solver", tokenizer_dir)
    store = ExperienceStore(["solver"])
    engine = ScriptedEngine([[12, 2], [13, 2], [12, 2], [14, 2]])
    ctx = ctx_for(store, engine, tokenizer_dir)
    texts = await ctx.generate("solver", "what is two plus one")
    assert engine.requests[0].prompt_ids == tok.encode("what is two plus one")
    chats = await ctx.chat("solver", [{"role": "user", "content": "what is two plus one"}])
    expected = tok.tok.apply_chat_template([{"role": "user", "content": "what is two plus one"}],
                                           add_generation_prompt=True, tokenize=True)
    assert engine.requests[1].prompt_ids == list(expected["input_ids"] if "input_ids" in expected else expected)
    assert [s.output_ids.tolist() for s in texts + chats] == [[12, 2], [13, 2], [12, 2], [14, 2]]
    assert [s.text for s in chats] == ["three", "wrong"]
    assert chats[0].messages[-1] == {"role": "assistant", "content": "three"}


async def test_a_conversation_is_one_sample_whose_mask_covers_only_the_agents_turns(tokenizer_dir):
    store = ExperienceStore(["solver"])
    engine = ScriptedEngine([[13, 2], [14, 2], [12, 2]])
    ctx = ctx_for(store, engine, tokenizer_dir)
    first, _ = await ctx.chat("solver", [{"role": "user", "content": "what is two plus one"}])
    engine.version = 1
    await ctx.continue_chat(first, [{"role": "user", "content": "wrong try again"}])
    tok = AgentTokenizer("solver", tokenizer_dir)
    appended = tok.encode("<user> wrong try again <eos> <assistant>")
    assert first.output_ids.tolist() == [13, 2] + appended + [12, 2]
    assert first.mask.tolist() == [1, 1] + [0] * len(appended) + [1, 1]
    assert first.versions == [0, 1] and first.text == "three"
    # the next turn continued from exactly the ids so far, not a re-tokenized text
    assert engine.requests[-1].prompt_ids == first.prompt_ids.tolist() + [13, 2] + appended
    turn = engine.requests[-1]
    assert (turn.key, turn.first, turn.turn, turn.n) == (first.key, first.member, 1, 1)
    group = sent(ctx, store, first)
    assert list(group.loss_mask[:len(first.mask)]) == first.mask.tolist() and group.versions == [0, 0]


async def test_every_turn_waits_at_the_staleness_gate(tokenizer_dir):
    store = ExperienceStore(["solver"])
    passed = []

    async def gate(agent, batch):
        passed.append((agent, batch))

    ctx = ctx_for(store, ScriptedEngine([[12, 2], [13, 2], [14, 2]]), tokenizer_dir, batch=3, gate=gate)
    first, _ = await ctx.chat("solver", [{"role": "user", "content": "hi"}])
    await ctx.continue_chat(first, [{"role": "user", "content": "again"}])
    assert passed == [("solver", 3), ("solver", 3)]


async def test_a_conversation_with_a_turn_older_than_the_bound_is_dropped_not_trained(tokenizer_dir):
    """Guarantee (docs/guide.md, "Modes and staleness"): with bound k, no
    sample generated by version < v - k trains version v; a conversation counts its
    oldest turn."""
    store = ExperienceStore(["solver"])
    engine = ScriptedEngine([[12, 2], [13, 2], [14, 2], [12, 2]])
    ctx = ctx_for(store, engine, tokenizer_dir, batch=3)  # trains version 2 into 3
    convs = await ctx.chat("solver", [{"role": "user", "content": "hi"}])
    engine.version = 2
    for c in convs:
        await ctx.continue_chat(c, [{"role": "user", "content": "again"}])
        ctx.reward(c, float(c is convs[0]))
    assert [c.versions for c in convs] == [[0, 2], [0, 2]]
    assert store.form_micro_batches("solver", 3, decisions.MicroBatchSize(8), True, True,
                                        max_staleness=1) == []
    assert all(c.status == DROPPED for c in convs)
    kept = ExperienceStore(["solver"])
    engine = ScriptedEngine([[12, 2], [13, 2], [14, 2], [12, 2]], version=1)
    ctx = ctx_for(kept, engine, tokenizer_dir, batch=3)
    convs = await ctx.chat("solver", [{"role": "user", "content": "hi"}])
    engine.version = 2
    for c in convs:
        await ctx.continue_chat(c, [{"role": "user", "content": "again"}])
        ctx.reward(c, float(c is convs[0]))
    (mb,) = kept.form_micro_batches("solver", 3, decisions.MicroBatchSize(8), True, True,
                                          max_staleness=1)
    assert mb.keys() == [convs[0].key] and mb.samples == len(convs)


async def test_a_rewarded_sample_takes_no_further_turn(tokenizer_dir):
    store = ExperienceStore(["solver"])
    ctx = ctx_for(store, ScriptedEngine([[12, 2], [13, 2], [14, 2]]), tokenizer_dir)
    a, b = await ctx.chat("solver", [{"role": "user", "content": "hi"}])
    ctx.reward(a, 1.0)
    with pytest.raises(ValueError, match="already rewarded"):
        await ctx.continue_chat(a, [{"role": "user", "content": "again"}])


async def test_a_conversation_keeps_each_turns_own_sampling_settings(tokenizer_dir):
    store = ExperienceStore(["solver"])
    engine = ScriptedEngine([[12, 2], [13, 2], [14, 2]])
    ctx = ctx_for(store, engine, tokenizer_dir)
    first, _ = await ctx.chat("solver", [{"role": "user", "content": "what is two plus one"}], top_p=0.9)
    await ctx.continue_chat(first, [{"role": "user", "content": "wrong try again"}], temperature=0.3, top_k=4)
    group = sent(ctx, store, first)
    assert (group.temperature, group.top_p, group.top_k) == (1.0, 0.9, 0)
    (turn,) = group.turns
    assert (turn.member, turn.temperature, turn.top_p, turn.top_k) == (first.member, 0.3, 1.0, 4)
    # the second turn's settings start at its first generated id, after the appended message
    assert group.loss_mask[turn.start] == 1 and group.loss_mask[turn.start - 1] == 0
    assert protocol.unpacked("i", group.output_ids).tolist()[turn.start:group.lengths[0]] == [14, 2]
