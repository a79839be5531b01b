"""A chat tokenized a message at a time (`ChatTokens`) gives the processor's ids exactly, kept
messages are not tokenized again, what it keeps is bounded, and a tokenizer it cannot cut
exactly is tokenized whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken

from omni_common.models.base import ChatTurn, GenerationRequest
from omni_common.models.qwen_omni.chat_tokens import MESSAGE_START, ChatTokens, cuts_exactly
from omni_common.models.qwen_omni.processor import OmniProcessor, load_processor, process

# Message texts whose edges test the cut: combining marks and whitespace at both ends, a typed
# message-start token, newlines, an empty message.
TEXTS = (
    "Once upon a time, the cat sat on a mat.",
    "e\u0301 caf\u00e9 \u0301",
    "  leading and trailing spaces  ",
    "\n\nnewlines\n\n",
    f"a typed {MESSAGE_START}user\ninside",
    "",
    "\u4f60\u597d\uff0c\u4e16\u754c",
    "tabs\tand\r\ncarriage returns\r\n",
)


@pytest.fixture(scope="module")
def processor(omni_model: Path) -> OmniProcessor:
    return load_processor(omni_model)


def chat(turns: int) -> GenerationRequest:
    messages = [ChatTurn("system", (("text", "You are a helpful assistant."),))]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append(ChatTurn(role, (("text", TEXTS[i % len(TEXTS)] + str(i)),)))
    return GenerationRequest(prompt="", messages=tuple(messages))


def test_ids_equal_the_processors_and_earlier_messages_are_kept(processor: OmniProcessor) -> None:
    tokens = ChatTokens(processor.tokenizer)
    assert tokens.cuts
    for turns in (1, 3, 9, 17):  # each a longer conversation that re-sends the one before
        request = chat(turns)
        fast = process(processor, request, {}, tokens)
        whole = process(processor, request, {})
        assert torch.equal(fast["input_ids"], whole["input_ids"])
        assert torch.equal(fast["attention_mask"], whole["attention_mask"])
        assert fast["input_ids"].dtype == whole["input_ids"].dtype == torch.int64
    misses = tokens.misses
    process(processor, chat(17), {}, tokens)
    assert tokens.misses == misses  # every message of a repeated chat was kept


def test_a_prompt_without_chat_markup_equals_the_tokenizers(processor: OmniProcessor) -> None:
    tokens = ChatTokens(processor.tokenizer)
    for text in TEXTS:
        assert list(tokens.ids(text)) == processor.tokenizer(text)["input_ids"]


def test_what_it_keeps_is_bounded(processor: OmniProcessor) -> None:
    tokens = ChatTokens(processor.tokenizer, max_ids=64)
    for turns in range(1, 30, 4):
        text = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{TEXTS[0]} {turns}"}] * turns, tokenize=False
        )
        assert list(tokens.ids(text)) == processor.tokenizer(text)["input_ids"]
        assert tokens._held <= 64


def test_a_marker_that_strips_to_its_left_is_not_cut(processor: OmniProcessor) -> None:
    tokenizer = processor.tokenizer.__class__.from_pretrained(processor.tokenizer.name_or_path)
    tokenizer.add_tokens([AddedToken(MESSAGE_START, lstrip=True, special=True, normalized=False)])
    assert not cuts_exactly(tokenizer, MESSAGE_START)
    tokens = ChatTokens(tokenizer)
    text = f"before  {MESSAGE_START}user\nafter"
    assert list(tokens.ids(text)) == tokenizer(text)["input_ids"]
    assert tokens.misses == 0  # tokenized whole, nothing kept
