"""A conversation's prefix KV moved to the replica that runs its next turn, or recomputed there.

Affinity (affinity.py) sends a conversation's next turn to the replica that keeps its earlier
turns' KV. When the pool picks another one (that replica is much busier), this asks the holder
for the KV of the longest kept prefix of the turn's prompt (StageRequest.export_prefix), as
handles made for the chosen replica by the transport (CUDA IPC on its GPU, shm on its host,
else fetched in chunks), and passes them on with the turn's inputs; the thinker there checks
them against its model and installs them in its prefix cache (omni_common/models/
prefix_transfer.py). The handles' leases are the request's, like any step output's: released
once the turn's call is over, and with everything else when the request ends.

Moving pays only when it beats the prefill it saves: `should_move` compares the transfer time
(the bytes over the handles' rate) with the time to prefill those tokens (the coordinator's
`prefix_prefill_tokens_per_s`). A holder that keeps nothing, is gone or fails the export costs
nothing but that call: the turn computes its whole prompt, as it would without moves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter

from omni_common.models.base import PlanStep
from omni_common.models.prefix_transfer import LENGTH
from omni_common.transport import TensorTransport
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.registry import Replica, ReplicaPool
from services.coordinator.request import FlowRequest

log = logging.getLogger("omnistage.coordinator")

# Bytes a second the choice assumes for each kind of handle (TensorRef.location), the slowest of
# a prefix's tensors counting. CUDA IPC: a device-to-device copy on one GPU. Shared memory: the
# exporter's copy into its arena, then the receiver's out of it (host memcpy, one core each).
# Inline bytes ride in the gRPC messages. Remote: the consumer pulls ~1 MiB chunks over gRPC
# from the producer's TensorStore, another host's, with copies at both ends.
LINK_BYTES_PER_S = {
    "cuda_ipc": 100e9,
    "shm": 4e9,
    "inline_data": 1e9,
    "remote": 0.5e9,
}

ExportMedia = Callable[[FlowRequest, PlanStep, stage_pb2.StageRequest, Replica], list[str]]


def should_move(nbytes: int, tokens: int, location: str, prefill_tokens_per_s: float) -> bool:
    """Whether moving a prefix of `tokens` tokens held in `nbytes` by `location` handles takes
    less time than prefilling those tokens at `prefill_tokens_per_s`."""
    if tokens <= 0 or prefill_tokens_per_s <= 0:
        return False
    return nbytes / LINK_BYTES_PER_S[location] < tokens / prefill_tokens_per_s


def slowest_location(state: tensor_pb2.StageState) -> str:
    """The kind of handle among `state`'s tensors with the lowest rate."""
    locations = {ref.WhichOneof("location") or "inline_data" for ref in state.tensors}
    return min(locations, key=LINK_BYTES_PER_S.__getitem__)


def with_prefix(inputs: tensor_pb2.StageState, moved: tensor_pb2.StageState | None) -> tensor_pb2.StageState:
    """A step's inputs plus a moved prefix's handles and meta (a copy; `inputs` unchanged)."""
    if moved is None:
        return inputs
    joined = tensor_pb2.StageState()
    joined.CopyFrom(inputs)
    joined.tensors.extend(moved.tensors)
    joined.meta.update(moved.meta)
    return joined


class PrefixMoves:
    """Exports prefixes from the replicas that keep them, and counts what became of each."""

    def __init__(
        self,
        pool: ReplicaPool,
        transport: TensorTransport,
        prefill_tokens_per_s: float,
        stage_timeout_s: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.pool = pool
        self.transport = transport
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.stage_timeout_s = stage_timeout_s
        self._moves = Counter(
            "omnistage_prefix_moves",
            "Chat turns that ran away from the replica keeping their prefix KV, by what became of "
            "it: 'moved' (by handle), 'recomputed' (moving would take longer than the prefill), "
            "'absent' (the holder kept none), 'failed' (the holder was gone or failed the export)",
            ["outcome"],
            registry=registry or CollectorRegistry(),
        )

    def count(self, outcome: str) -> None:
        self._moves.labels(outcome=outcome).inc()

    async def fetch(
        self,
        req: FlowRequest,
        step: PlanStep,
        holder: str,
        target: Replica,
        inputs: tensor_pb2.StageState,
        export_media: ExportMedia,
    ) -> tensor_pb2.StageState | None:
        """The prefix KV `holder` keeps of `step`'s prompt as handles for `target`, when moving
        them is cheaper than recomputing (their leases are in `req.leases`); else None (also
        when no other replica holds it, and when moves are off)."""
        if not holder or holder == target.address or self.prefill_tokens_per_s <= 0:
            return None
        replica = self.pool.by_address(holder)
        if replica is None or not replica.healthy or target.info is None:
            self.count("failed")
            return None
        output = await self._export(req, step, replica, target, inputs, export_media)
        if output is None or not output.tensors:
            self.count("failed" if output is None else "absent")
            return None
        nbytes, tokens = sum(ref.nbytes for ref in output.tensors), int(output.meta.get(LENGTH, "0"))
        location = slowest_location(output)
        if not should_move(nbytes, tokens, location, self.prefill_tokens_per_s):
            req.leases.drop(holder, output)
            self.count("recomputed")
            return None
        self.count("moved")
        moves = "request %s: %d prefix tokens (%d bytes, %s) move from %s to %s"
        log.info(moves, req.request_id, tokens, nbytes, location, holder, target.address)
        return output

    async def _export(
        self,
        req: FlowRequest,
        step: PlanStep,
        holder: Replica,
        target: Replica,
        inputs: tensor_pb2.StageState,
        export_media: ExportMedia,
    ) -> tensor_pb2.StageState | None:
        """`holder`'s export call (None when it fails: the turn then recomputes)."""
        assert target.info is not None
        request = stage_pb2.StageRequest(
            request_id=req.request_id,
            params=req.params,
            input=inputs,
            role=step.role,
            consumer_host_id=target.info.host_id,
            consumer_gpu_uuid=target.info.gpu_uuid,
            consumer_ipc_namespace=target.info.ipc_namespace,
            export_prefix=True,
        )
        own_leases = export_media(req, step, request, holder)
        output = None
        try:
            async for event in holder.stub.Run(request, timeout=req.timeout(self.stage_timeout_s)):
                if event.HasField("result"):
                    output = event.result.output
                    req.leases.add(holder.address, output)
        except grpc.RpcError as err:
            failed = "request %s: no prefix from %s (%s: %s); the turn computes it"
            log.warning(failed, req.request_id, holder.address, err.code().name, (err.details() or "")[:200])
            return None
        finally:
            self.transport.release(own_leases)
        return output
