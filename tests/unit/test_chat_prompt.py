"""worker/tokenizer.py's chat_prompt_ids: one conversation is one prompt for every front end and
the offline API (the template's text, BOS first once, a template override, no template: an error)."""

from __future__ import annotations

import pytest

from worker.tokenizer import ByteTokenizer, ChatTemplateError, chat_prompt_ids

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_built_in_plain_template_with_bos_first() -> None:
    tokenizer = ByteTokenizer()
    assert chat_prompt_ids(tokenizer, MESSAGES) == [256, *b"user: hi\nassistant: "]
    assert chat_prompt_ids(tokenizer, MESSAGES, add_generation_prompt=False) == [256, *b"user: hi\n"]


def test_a_template_override_and_a_template_that_writes_its_own_bos() -> None:
    tokenizer = ByteTokenizer()
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    # The template's BOS text is a special token's name: encoded without specials it stays text,
    # so the BOS id still goes first, once.
    ids = chat_prompt_ids(tokenizer, MESSAGES, template=template)
    assert ids[0] == 256 and ids.count(256) == 1
    assert bytes(ids[1:]).endswith(b"[user]hi<|eos|>")


def test_no_template_and_bad_messages_are_chat_template_errors() -> None:
    class NoTemplate(ByteTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise ChatTemplateError("this tokenizer has no chat template")

    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_prompt_ids(NoTemplate(), MESSAGES)
    with pytest.raises(ChatTemplateError, match="content"):
        chat_prompt_ids(ByteTokenizer(), [{"role": "user"}], template="{{ messages }}")
