"""How tensors cross process and host boundaries: inline bytes, shm leases, CUDA IPC,
chunked fetch."""

from .codec import DTYPES, decode_inline, dtype_name, encode_inline
from .lease_table import sweep_stale_segments
from .remote import fetch_remote, release_remote
from .route import Consumer, gpu_uuid, host_id_default, ipc_namespace
from .store import TensorStoreServicer, add_tensor_store
from .transport import TensorTransport

__all__ = [
    "DTYPES",
    "Consumer",
    "TensorStoreServicer",
    "TensorTransport",
    "add_tensor_store",
    "decode_inline",
    "dtype_name",
    "encode_inline",
    "fetch_remote",
    "gpu_uuid",
    "host_id_default",
    "ipc_namespace",
    "release_remote",
    "sweep_stale_segments",
]
