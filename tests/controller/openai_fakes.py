"""What the OpenAI endpoint's unit tests share: a byte-level BPE tokenizer with a chat
template, an engine that answers with scripted ids, and an episode whose context has the
real endpoint (real HTTP on loopback, the real `openai` client) in front of it."""

from __future__ import annotations

import contextlib
import random
from typing import NamedTuple

import pytest

from flexmarl.controller.episodes.tokens import AgentTokenizer
from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext
from flexmarl.controller.serving.openai_api import OpenAIEndpoint
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import ExperienceStore
from flexmarl.runtime.config import OpenAIConfig
from flexmarl.runtime.keys import TurnKey

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]
TEXT = ["What is 12 + 30?", "It is 42.", "Try again.", "The answer is 12.", "add", "arguments",
        '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>', "The tool says 42."] * 20


def build_tokenizer(folder) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The agent's tokenizer, as the controller loads it."""
    return AgentTokenizer("solver", build_tokenizer(tmp_path_factory.mktemp("tok")))


class Asked(NamedTuple):
    """One member of a group the engine was asked for."""

    sample_id: str
    seed: int
    prompt_ids: list[int]
    temperature: float


class ScriptedEngine:
    """Answers every request with the next scripted reply: token ids, or text (its ids
    then EOS), with a logprob of -0.25 per token, at `version`."""

    def __init__(self, tokenizer: AgentTokenizer, replies: list, version: int = 0) -> None:
        self.tok, self.replies, self.version, self.requests = tokenizer, list(replies), version, []

    def ids(self, reply) -> list[int]:
        return list(reply) if isinstance(reply, list) else self.tok.encode(reply) + [self.tok.eos_token_id]

    async def generate(self, agent, group, after=""):
        name = (lambda j: str(TurnKey(group.key, group.first, group.turn))) if group.turn else group.key.sample
        members = [Asked(name(group.first + j), group.seed + j, group.prompt_ids, group.temperature)
                   for j in range(group.n)]
        self.requests += members
        replies = []
        for _ in members:
            if isinstance(self.replies[0], Exception):
                raise self.replies.pop(0)
            replies.append(self.ids(self.replies.pop(0)))
        return output_of(replies, [[-0.25] * len(ids) for ids in replies], self.version, finish_reason="stop")


def make_context(endpoint, engine, tokenizer, episode_id="e0", group_size=2, store=None, **options):
    store = store or ExperienceStore(["solver"])
    return EpisodeContext(episode_id, 1, random.Random(0), store, engine, {"solver": AgentDefaults(8, 1.0, group_size)},
                          run_seed=1, tokenizers={"solver": tokenizer}, endpoint=endpoint, **options)


@contextlib.asynccontextmanager
async def running_endpoint(parsers=None, **cfg):
    endpoint = OpenAIEndpoint(OpenAIConfig(enabled=True, **cfg), {"solver": "models/solver"}, parsers or {})
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.stop()
