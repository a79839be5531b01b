"""The one tensor codec: dtype names, header checks, and raw-byte views of tensors.

Bytes are the tensor's own row-major bytes; nothing is widened (bf16 stays two bytes) and
nothing is pickled.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from omni_common.errors import InvalidArgument, ResourceExhausted
from omnistage.v1 import tensor_pb2

# Quantized dtypes carry a scale and zero point outside their bytes, so raw bytes alone
# cannot round-trip them; every other torch dtype can.
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    if str(d).removeprefix("torch.") not in _QUANTIZED
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype ("bfloat16"); InvalidArgument for dtypes we cannot carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgument(f"dtype {name} cannot be sent as raw bytes")
    return name


def check_header(ref: tensor_pb2.TensorRef, max_tensor_bytes: int) -> tuple[torch.dtype, list[int]]:
    """Validate dtype, shape and nbytes of a ref; returns (dtype, shape)."""
    dtype = DTYPES.get(ref.dtype)
    if dtype is None:
        raise InvalidArgument(f"tensor {ref.name!r}: unknown dtype {ref.dtype[:32]!r}")
    shape = list(ref.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor {ref.name!r}: negative dimension in shape")
    if ref.nbytes > max_tensor_bytes:
        raise ResourceExhausted(
            f"tensor {ref.name!r}: {ref.nbytes} bytes exceeds the limit of {max_tensor_bytes}"
        )
    # math.prod on Python ints cannot overflow; compare before allocating anything.
    if math.prod(shape) * dtype.itemsize != ref.nbytes:
        raise InvalidArgument(f"tensor {ref.name!r}: nbytes does not match shape and dtype")
    return dtype, shape


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU, contiguous (CUDA tensors are copied down for now)."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def encode_inline(name: str, tensor: torch.Tensor) -> tensor_pb2.TensorRef:
    """A TensorRef that carries the tensor's bytes in the message."""
    t = host_contiguous(tensor)
    data = byte_array(t).tobytes()
    return tensor_pb2.TensorRef(
        name=name,
        dtype=dtype_name(t.dtype),
        shape=list(t.shape),
        nbytes=len(data),
        inline_data=data,
    )


def empty_for(dtype: torch.dtype, shape: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh tensor and a writable uint8 view of its bytes."""
    t = torch.empty(shape, dtype=dtype)
    return t, byte_array(t)


def decode_inline(ref: tensor_pb2.TensorRef, max_tensor_bytes: int) -> torch.Tensor:
    """A fresh tensor from an inline TensorRef."""
    dtype, shape = check_header(ref, max_tensor_bytes)
    if len(ref.inline_data) != ref.nbytes:
        raise InvalidArgument(f"tensor {ref.name!r}: inline data length does not match nbytes")
    t, dst = empty_for(dtype, shape)
    if ref.nbytes:
        dst[:] = np.frombuffer(ref.inline_data, dtype=np.uint8)
    return t


PARALLEL_COPY_BYTES = 1 << 20


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for uint8 arrays; large copies use torch's multi-threaded copy, which
    also spreads the page faults of fresh memory over the cores."""
    if dst.nbytes < PARALLEL_COPY_BYTES:
        np.copyto(dst, src)
        return
    with warnings.catch_warnings():
        # src may be a read-only shared-memory map: it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(dst).copy_(torch.from_numpy(src))
