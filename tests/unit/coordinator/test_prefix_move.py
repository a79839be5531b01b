"""The choice between moving a conversation's prefix KV and recomputing it: move when the bytes
over the handles' rate take less time than prefilling the tokens at the configured rate."""

from __future__ import annotations

from omni_common.models.base import PrefixKeys
from omnistage.v1 import tensor_pb2
from services.coordinator.affinity import PrefixRoutes
from services.coordinator.prefix_move import LINK_BYTES_PER_S, should_move, slowest_location, with_prefix

# The 7B thinker's KV of one token: 28 layers x (keys + values) x 4 heads x 128 x bf16, plus its
# talker row (3584 x bf16).
TOKEN_BYTES = 28 * 2 * 4 * 128 * 2 + 3584 * 2


def test_a_same_host_move_beats_the_prefill_and_a_slow_link_does_not() -> None:
    tokens = 2000
    assert should_move(tokens * TOKEN_BYTES, tokens, "shm", prefill_tokens_per_s=10_000)
    assert should_move(tokens * TOKEN_BYTES, tokens, "cuda_ipc", prefill_tokens_per_s=10_000)
    assert not should_move(tokens * TOKEN_BYTES, tokens, "remote", prefill_tokens_per_s=10_000)
    # A slow prefill (a big model on a small device) makes even the slow link pay.
    assert should_move(tokens * TOKEN_BYTES, tokens, "remote", prefill_tokens_per_s=1_000)


def test_the_choice_turns_where_the_two_times_meet() -> None:
    rate = LINK_BYTES_PER_S["shm"]
    # 1000 tokens at 1000 tokens/s take 1 s; moving `rate` bytes takes 1 s too.
    assert not should_move(int(rate), 1000, "shm", prefill_tokens_per_s=1000)
    assert should_move(int(rate) - 1, 1000, "shm", prefill_tokens_per_s=1000)


def test_no_tokens_or_no_rate_recomputes() -> None:
    assert not should_move(1, 0, "shm", prefill_tokens_per_s=10_000)
    assert not should_move(1, 100, "shm", prefill_tokens_per_s=0)


def ref(location: str) -> tensor_pb2.TensorRef:
    tensor = tensor_pb2.TensorRef(name="prefix.keys.0", nbytes=4)
    if location == "remote":
        tensor.remote.producer_address = "10.0.0.1:1"
    elif location == "shm":
        tensor.shm.nbytes = 4
    else:
        tensor.inline_data = b"0000"
    return tensor


def test_the_slowest_handle_sets_the_rate() -> None:
    assert slowest_location(tensor_pb2.StageState(tensors=[ref("shm"), ref("inline")])) == "inline_data"
    assert slowest_location(tensor_pb2.StageState(tensors=[ref("shm"), ref("remote")])) == "remote"
    assert slowest_location(tensor_pb2.StageState(tensors=[ref("shm")])) == "shm"


def test_with_prefix_adds_the_handles_to_a_copy() -> None:
    inputs = tensor_pb2.StageState(tensors=[ref("inline")], meta={"a": "1"})
    moved = tensor_pb2.StageState(tensors=[ref("shm")], meta={"prefix.length": "3"})
    joined = with_prefix(inputs, moved)
    assert len(joined.tensors) == 2 and dict(joined.meta) == {"a": "1", "prefix.length": "3"}
    assert len(inputs.tensors) == 1 and dict(inputs.meta) == {"a": "1"}
    assert with_prefix(inputs, None) is inputs


def test_the_holder_is_remembered_even_when_it_may_not_take_the_turn() -> None:
    routes = PrefixRoutes(8)
    first = PrefixKeys(reuses=(), leaves="one")
    routes.remember("m", first, "a:1")
    second = PrefixKeys(reuses=("one",), leaves="two")
    assert routes.holder("m", second) == "a:1"
    assert routes.holder("other", second) == "" and routes.holder("m", None) == ""
    assert routes.preferred("m", second, usable={"b:1"}) == ""  # a:1 is not usable: forgotten
    assert routes.holder("m", second) == ""
