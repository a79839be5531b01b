"""Content keys of a conversation, computed from the request alone (no tokenizer), by which the
coordinator sends a conversation's next turn to the replica that keeps its earlier turns' KV.

A generator's prefix cache (prefix_cache.py) keys an entry by the prompt's token ids and the
digests of the media in it. The coordinator has no tokenizer, so it keys a conversation by what
the request says: each turn's role, its text and its media's digests, in order. Why that names
the right replica closely enough:
- equal keys mean equal messages, which the chat template renders to equal tokens, so the key
  of the messages a turn sent names the replica that cached that turn's prompt (and its prompt
  plus reply);
- the next turn re-sends those messages, then the reply as an assistant turn, then a new user
  turn, so its prompt starts with the earlier prompt's tokens wherever the template renders an
  earlier turn the same way as history (the Qwen templates do).
Where it does not, or the entry was evicted, or the replica restarted, the thinker finds no
prefix under its own token-level key and computes the whole prompt: a key that names the wrong
replica costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json

from omni_common.models.base import ChatTurn, GenerationRequest, PrefixKeys


def turns_of(request: GenerationRequest) -> tuple[ChatTurn, ...]:
    """The request's conversation: its messages, else one user turn of its media (audio clips,
    then images, then videos) and its prompt."""
    if request.messages:
        return request.messages
    parts: tuple[tuple[str, str | int], ...] = (
        *(("audio", i) for i in range(len(request.audios))),
        *(("image", i) for i in range(len(request.images))),
        *(("video", i) for i in range(len(request.videos))),
        ("text", request.prompt),
    )
    return (ChatTurn("user", parts),)


def conversation_key(request: GenerationRequest, turns: tuple[ChatTurn, ...]) -> str:
    """The content key of `turns` (of `request`): roles, texts and media digests, in order; a
    text-only turn counts as its joined text (the template renders it as one string)."""
    canonical: list[object] = []
    for turn in turns:
        if all(kind == "text" for kind, _ in turn.parts):
            parts: list[object] = [["text", "".join(str(text) for _, text in turn.parts)]]
        else:
            parts = [[kind, _content(request, kind, value)] for kind, value in turn.parts]
        canonical.append([turn.role, parts])
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False).encode()).hexdigest()


def _content(request: GenerationRequest, kind: str, value: str | int) -> str:
    if kind == "audio":
        return request.audios[int(value)].digest
    if kind == "image":
        return request.images[int(value)].digest
    if kind == "video":
        return request.videos[int(value)].digest
    return str(value)


def prefix_keys(request: GenerationRequest) -> PrefixKeys:
    """The keys of the earlier turns' requests this one continues (the messages before each of
    its assistant turns, longest first) and its own."""
    turns = turns_of(request)
    earlier = [i for i in range(len(turns) - 1, 0, -1) if turns[i].role == "assistant"]
    return PrefixKeys(
        reuses=tuple(conversation_key(request, turns[:i]) for i in earlier),
        leaves=conversation_key(request, turns),
    )
