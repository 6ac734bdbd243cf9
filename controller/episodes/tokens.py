"""Each agent's tokenizer on the controller: text and chat in, token ids out.

Token ids are the source of truth. The controller turns a workflow's text or chat
messages into prompt ids with the agent's own tokenizer and chat template (loaded from
its model directory by transformers); what the engine generates comes back as ids and is
trained as those exact ids, never re-tokenized. Text is only ever decoded from ids, for
the workflow to read.

A conversation that goes on (`continue_chat`) appends the ids of the new messages only:
the chat template is rendered for the conversation with and without them, and the
difference is tokenized. The assistant turns already in it stay the engine's ids; when an
engine turn ended with the end-of-sequence token and the template writes that token again
as the turn's end, the copy is dropped from the appended text.

A prompt's size is checked before it is tokenized (`sized`): a token stands for at most
`token_chars` characters (the vocabulary's longest entry), so text of more than twice that
many characters per token allowed cannot fit and is refused at once, whatever its length;
large text that may fit is rendered and tokenized in a thread, so the controller's event
loop never works through megabytes of it. The exact count is checked against the room
once the ids exist.

It does not know engines, samples or the store.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable

Messages = list[dict[str, Any]]

# Text longer than this (characters) is rendered and tokenized in a thread, off the event loop.
OFF_LOOP_CHARS = 32 * 1024
# A text of c characters has at least c / (SLACK * token_chars) tokens: the slack covers
# normalizers that compose characters (NFC) on the way in.
SLACK = 2
# Keys of a Hugging Face config.json that give a model's longest context, first found wins.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class TokenizerError(ValueError):
    """The agent's tokenizer cannot do what the workflow asked (no chat template, say)."""


class PromptTooLong(TokenizerError):
    """A prompt that cannot fit the room it is given (the agent's context, a request cap)."""


def model_context(model_dir: str) -> int:
    """The longest context the model in `model_dir` takes, from its config.json (0: unknown):
    an engine's context is never longer unless it was told so."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    return next((int(config[k]) for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0), 0)


def text_size(messages: Messages) -> int:
    """The characters of the messages' text contents (parts of other kinds count nothing)."""
    size = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return size


class AgentTokenizer:
    def __init__(self, agent: str, model_dir: str, context: int = 0) -> None:
        from transformers import AutoTokenizer

        self.agent = agent
        try:
            self.tok = AutoTokenizer.from_pretrained(model_dir)
        except Exception as exc:
            raise TokenizerError(f"agent {agent}: no tokenizer could be loaded from {model_dir}: {exc}") from None
        self.eos_token_id = self.tok.eos_token_id
        # The most tokens (prompt and output) an engine of this agent takes: the configured
        # max_model_len, else the model's own; 0: unknown (the engine alone checks).
        self.context = context or model_context(model_dir)
        self.token_chars = max(1, max((len(t) for t in self.tok.get_vocab()), default=1))

    def least_tokens(self, chars: int) -> int:
        """The fewest tokens a text of `chars` characters can be."""
        return chars // (SLACK * self.token_chars)

    async def sized(self, chars: int, room: int, tokenize: Callable[[], list[int]], what: str = "the prompt") -> list[int]:
        """`tokenize()`'s ids for a text of `chars` characters, refused (PromptTooLong) when
        they cannot fit in `room` tokens (0: no limit): at once when even the fewest tokens
        such a text can be are too many, else once counted. Large text is tokenized in a
        thread."""
        if room and self.least_tokens(chars) > room:
            raise PromptTooLong(f"{what} is at least {self.least_tokens(chars)} tokens ({chars} characters); agent "
                                f"{self.agent} takes at most {room} here")
        ids = await asyncio.to_thread(tokenize) if chars > OFF_LOOP_CHARS else tokenize()
        if room and len(ids) > room:
            raise PromptTooLong(f"{what} is {len(ids)} tokens; agent {self.agent} takes at most {room} here")
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _template(self, messages: Messages, generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise TokenizerError(f"agent {self.agent}: its tokenizer has no chat template; use ctx.generate with "
                                 f"text or ids, or add a chat_template to its tokenizer_config.json")
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def chat_prompt(self, messages: Messages, tools: list[dict] | None = None) -> list[int]:
        """The ids of a conversation, ready for the assistant's next turn; `tools` (JSON
        schemas, as the OpenAI API gives them) are handed to the chat template."""
        return self._encode_rendered(self._template(messages, True, tools))

    def chat_delta(self, before: Messages, after: Messages, ended_with_eos: bool,
                   tools: list[dict] | None = None) -> list[int]:
        """The ids to append to a conversation `before` (whose last message is the
        assistant's, as generated) so that it becomes `after` plus the generation prompt."""
        old = self._template(before, False, tools)
        new = self._template(after, True, tools)
        if not new.startswith(old):
            # Some templates render the last assistant turn differently once another
            # message follows; cut where the assistant's text ends instead.
            last = before[-1]["content"]
            cut = new.find(last, len(new) - len(new.lstrip()))
            if cut < 0:
                raise TokenizerError(f"agent {self.agent}: the chat template rewrites earlier turns, so the "
                                     f"conversation cannot be extended without re-tokenizing it")
            old = new[:cut + len(last)]
        delta = new[len(old):]
        # `old` may already end with the end-of-turn marker after the assistant's text;
        # count back to the text so the marker is appended unless the engine wrote it.
        content_end = old.rfind(before[-1]["content"]) + len(before[-1]["content"])
        delta = old[content_end:] + delta
        eos_text = self.tok.eos_token or ""
        at = delta.find(eos_text) if ended_with_eos and eos_text else -1
        if at >= 0 and not delta[:at].strip():  # the engine's turn already ends with it
            delta = delta[:at] + delta[at + len(eos_text):]
        return self._encode_rendered(delta)

    def _encode_rendered(self, text: str) -> list[int]:
        # The template already wrote every special token it wants: add none.
        return list(self.tok.encode(text, add_special_tokens=False))
