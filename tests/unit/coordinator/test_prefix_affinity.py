"""Conversation affinity as bookkeeping: the keys a turn leaves are the keys the next turn looks
for, the coordinator's map sends a turn to the replica that served the conversation unless it
is gone or much busier, and it stays bounded."""

from __future__ import annotations

from omni_common.input_media import AudioInput, VideoInput
from omni_common.models.base import ChatTurn, GenerationRequest, PrefixKeys
from omni_common.models.conversation_keys import prefix_keys
from omnistage.v1 import stage_pb2
from services.coordinator.affinity import PrefixRoutes
from services.coordinator.registry import PREFER_SLACK, Replica, ReplicaPool

CLIP = AudioInput(sample_rate=16_000, frames=16_000, digest="a" * 64)
OTHER_CLIP = AudioInput(sample_rate=16_000, frames=16_000, digest="b" * 64)
VIDEO = VideoInput(frames=4, width=56, height=56, fps=2.0, digest="c" * 64)
OTHER_VIDEO = VideoInput(frames=4, width=56, height=56, fps=2.0, digest="d" * 64)


def turns(*texts: str) -> tuple[ChatTurn, ...]:
    """A conversation alternating user and assistant turns, the first user turn with a clip."""
    first = ChatTurn("user", (("audio", 0), ("text", texts[0])))
    roles = ("user", "assistant")
    return (first, *(ChatTurn(roles[i % 2], (("text", t),)) for i, t in enumerate(texts[1:], start=1)))


def test_each_turn_looks_for_the_conversations_the_earlier_turns_left() -> None:
    one = prefix_keys(GenerationRequest(prompt="hi", audios=(CLIP,)))  # no messages: one user turn
    two = prefix_keys(GenerationRequest(prompt="", audios=(CLIP,), messages=turns("hi", "hello", "more")))
    three = prefix_keys(
        GenerationRequest(prompt="", audios=(CLIP,), messages=turns("hi", "hello", "more", "ok", "again"))
    )
    assert one.reuses == ()
    assert two.reuses == (one.leaves,)
    assert three.reuses == (two.leaves, one.leaves)  # longest first
    assert len({one.leaves, two.leaves, three.leaves}) == 3


def test_a_key_names_the_media_by_content() -> None:
    heard = prefix_keys(GenerationRequest(prompt="hi", audios=(CLIP,)))
    assert prefix_keys(GenerationRequest(prompt="hi", audios=(OTHER_CLIP,))).leaves != heard.leaves
    split = GenerationRequest(prompt="", messages=(ChatTurn("user", (("text", "h"), ("text", "i"))),))
    assert prefix_keys(split).leaves == prefix_keys(GenerationRequest(prompt="hi")).leaves
    seen = prefix_keys(GenerationRequest(prompt="hi", videos=(VIDEO,)))
    assert prefix_keys(GenerationRequest(prompt="hi", videos=(OTHER_VIDEO,))).leaves != seen.leaves
    assert seen.leaves != prefix_keys(GenerationRequest(prompt="hi")).leaves


def pool_of(*addresses: str) -> ReplicaPool:
    pool = ReplicaPool()
    pool.replicas["ar-encoder"] = []
    for address in addresses:
        info = stage_pb2.StageInfo(
            stage="ar-encoder", model="m", family="qwen2.5-omni", host_id="h", address=address
        )
        pool.replicas["ar-encoder"].append(Replica("ar-encoder", address, None, info=info))  # type: ignore[arg-type]
    return pool


def test_the_replica_that_keeps_the_prefix_wins_unless_it_is_much_busier() -> None:
    pool = pool_of("a:1", "b:1")
    b = pool.replicas["ar-encoder"][1]
    assert pool.pick("ar-encoder", "m").address == "a:1"
    assert pool.pick("ar-encoder", "m", prefer="b:1").address == "b:1"
    b.in_flight = PREFER_SLACK
    assert pool.pick("ar-encoder", "m", prefer="b:1").address == "b:1"
    b.in_flight = PREFER_SLACK + 1
    assert pool.pick("ar-encoder", "m", prefer="b:1").address == "a:1"
    assert pool.pick("ar-encoder", "m", prefer="b:1", avoid=frozenset({"a:1"})).address == "b:1"
    assert pool.pick("ar-encoder", "m", prefer="gone:1").address == "a:1"


def test_a_draining_replica_gets_no_new_work_but_stays_reachable_for_its_prefixes() -> None:
    pool = pool_of("a:1", "b:1")
    b = pool.replicas["ar-encoder"][1]
    assert b.info is not None
    b.info.draining = True  # its heartbeat or Info says it drains but lingers
    assert [r.address for r in pool.serving("ar-encoder", "m")] == ["a:1"]
    assert pool.pick("ar-encoder", "m", prefer="b:1").address == "a:1"
    assert pool.models()["m"].stages == {"ar-encoder": 1}
    assert pool.healthy_counts() == {"ar-encoder": 1}
    # ... while its prefix exports and its tensors' fetches still go to it
    assert pool.by_address("b:1") is b and b.healthy and pool.is_alive("b:1")
    routes = PrefixRoutes(max_entries=4)
    routes.remember("m", PrefixKeys((), "k1"), "b:1")
    next_turn = PrefixKeys(("k1",), "k2")
    assert routes.holder("m", next_turn) == "b:1"  # what the flow asks before it picks
    usable = {r.address for r in pool.serving("ar-encoder", "m")}
    assert routes.preferred("m", next_turn, usable) == ""


def test_routes_remember_forget_and_stay_bounded() -> None:
    routes = PrefixRoutes(max_entries=2)
    first, second, third = (PrefixKeys(reuses=(), leaves=k) for k in ("k1", "k2", "k3"))
    routes.remember("m", first, "a:1")
    routes.remember("m", second, "b:1")
    assert routes.preferred("m", PrefixKeys(("k2", "k1"), "k4"), {"a:1", "b:1"}) == "b:1"
    # b is gone: its entry is forgotten and the shorter prefix's replica is taken
    assert routes.preferred("m", PrefixKeys(("k2", "k1"), "k4"), {"a:1"}) == "a:1"
    assert len(routes) == 1
    assert routes.preferred("other-model", PrefixKeys(("k1",), "k4"), {"a:1"}) == ""
    routes.remember("m", second, "b:1")
    routes.remember("m", third, "b:1")  # evicts the least recently used: k1
    assert routes.preferred("m", PrefixKeys(("k1",), "k4"), {"a:1", "b:1"}) == ""
    routes.forget("b:1")
    assert len(routes) == 0


def test_routes_off_remember_nothing() -> None:
    routes = PrefixRoutes(max_entries=0)
    routes.remember("m", PrefixKeys((), "k1"), "a:1")
    assert routes.preferred("m", PrefixKeys(("k1",), "k2"), {"a:1"}) == ""
