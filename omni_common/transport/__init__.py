"""How tensors cross process and host boundaries: inline bytes, shm leases, chunked fetch."""

from .codec import DTYPES, decode_inline, dtype_name, encode_inline
from .leases import sweep_stale_segments
from .store import TensorStoreServicer, add_tensor_store, fetch_remote, release_remote
from .transport import TensorTransport, host_id_default

__all__ = [
    "DTYPES",
    "TensorStoreServicer",
    "TensorTransport",
    "add_tensor_store",
    "decode_inline",
    "dtype_name",
    "encode_inline",
    "fetch_remote",
    "host_id_default",
    "release_remote",
    "sweep_stale_segments",
]
