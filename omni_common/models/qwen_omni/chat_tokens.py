"""A text-only chat's token ids, tokenized a message at a time, each message's ids kept for the
next turn: a conversation re-sends every earlier turn, and a 2,000-token history costs the
tokenizer milliseconds a turn (the largest part of a reused prefix's host time after the
prefill). A turn now tokenizes only the messages it adds.

Exact, not approximate: the chat template opens every message with `<|im_start|>`, a special
added token that the tokenizer splits out before it normalizes, pre-tokenizes and merges the
text between such tokens. So the ids of a text cut right before each `<|im_start|>` are the ids
of its pieces, concatenated. `ChatTokens` cuts only where that holds for the tokenizer it is
given (the token is special, matched before normalization, strips no whitespace to its left,
and the tokenizer adds no token of its own around a text); otherwise it tokenizes whole texts.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

MESSAGE_START = "<|im_start|>"
# Kept messages' ids at most (a 7B thinker's context is 32k tokens: many conversations' worth).
DEFAULT_MAX_IDS = 1 << 20


class ChatTokens:
    """`tokenizer`'s ids of rendered chats (`ids`), a message at a time, the most recently used
    messages' ids kept (at most `max_ids` ids in all)."""

    def __init__(self, tokenizer: Any, max_ids: int = DEFAULT_MAX_IDS) -> None:
        self.tokenizer = tokenizer
        self.max_ids = max_ids
        self.cuts = cuts_exactly(tokenizer, MESSAGE_START)
        self._kept: OrderedDict[str, array[int]] = OrderedDict()  # 8 bytes an id
        self._held = 0
        self.hits = self.misses = 0

    def ids(self, text: str) -> array[int]:
        """`tokenizer(text)["input_ids"]` (int64s: a tensor takes them without a copy per id)."""
        if not self.cuts:
            return array("q", self.tokenizer(text)["input_ids"])
        ids: array[int] = array("q")
        for piece in pieces(text, MESSAGE_START):
            ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> array[int]:
        found = self._kept.get(piece)
        if found is not None:
            self._kept.move_to_end(piece)
            self.hits += 1
            return found
        self.misses += 1
        ids = array("q", self.tokenizer(piece, add_special_tokens=False)["input_ids"])
        if len(ids) <= self.max_ids:
            self._kept[piece] = ids
            self._held += len(ids)
            while self._held > self.max_ids:
                _, dropped = self._kept.popitem(last=False)
                self._held -= len(dropped)
        return ids


def pieces(text: str, marker: str) -> list[str]:
    """`text` cut right before each `marker` (no empty piece)."""
    parts = text.split(marker)
    return ([parts[0]] if parts[0] else []) + [marker + part for part in parts[1:]]


def cuts_exactly(tokenizer: Any, marker: str) -> bool:
    """Whether `tokenizer`'s ids of a text equal those of its pieces cut before `marker`: the
    marker is a special token matched before normalization that strips nothing to its left, and
    the tokenizer adds no token around a text."""
    added = [token for token in tokenizer.added_tokens_decoder.values() if token.content == marker]
    if len(added) != 1 or not added[0].special or added[0].normalized or added[0].lstrip:
        return False
    plain, framed = (tokenizer("a", add_special_tokens=add)["input_ids"] for add in (False, True))
    return list(plain) == list(framed)
