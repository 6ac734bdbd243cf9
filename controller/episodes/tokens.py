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

It does not know engines, samples or the store.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]


class TokenizerError(ValueError):
    """The agent's tokenizer cannot do what the workflow asked (no chat template, say)."""


class AgentTokenizer:
    def __init__(self, agent: str, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.agent = agent
        try:
            self.tok = AutoTokenizer.from_pretrained(model_dir)
        except Exception as exc:
            raise TokenizerError(f"agent {agent}: no tokenizer could be loaded from {model_dir}: {exc}") from None
        self.eos_token_id = self.tok.eos_token_id

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
