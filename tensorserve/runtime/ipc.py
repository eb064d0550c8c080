"""Messages between the server and a model's worker process.

One message on a stream socket (a ``socketpair``, never a network socket):

    u32 little-endian   length of the header
    header              msgpack map; its "tensors" entry lists
                        [name, dtype, shape] of each tensor that follows
    tensor bytes        each tensor's raw bytes, in that order, back to back

Tensors travel as raw bytes (no pickle, no copy into the header) and are
read into one buffer per message, of which the received arrays are
zero-copy views. bfloat16 travels as its uint16 bit patterns, as on the wire
(see ``tensorserve.wire.dtypes``).
"""

from __future__ import annotations

import math
import socket
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from tensorserve.wire.dtypes import dtype

_LENGTH = struct.Struct("<I")
# Both ends are ours, but a corrupted stream must not make us allocate
# without bound.
MAX_HEADER_BYTES = 16 << 20

Message = tuple[dict[str, Any], dict[str, np.ndarray]]


def send(sock: socket.socket, header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None) -> None:
    """Send ``header`` and the named host arrays (dtype given per array by name)."""
    # (not ascontiguousarray: it turns a 0-d array into a 1-d one)
    arrays = [a if a.flags.c_contiguous else a.copy() for a in (tensors or {}).values()]
    names = list(tensors or {})
    head = msgpack.packb(
        {
            **header,
            # bfloat16 arrays are uint16 here; the receiver's config says
            # which features are bfloat16, exactly as on the wire.
            "tensors": [[name, a.dtype.name, list(a.shape)] for name, a in zip(names, arrays)],
        }
    )
    sock.sendall(_LENGTH.pack(len(head)) + head)
    for array in arrays:
        if array.nbytes:
            sock.sendall(array.reshape(-1).view(np.uint8).data)


def recv(sock: socket.socket) -> Message:
    """The next message; ``EOFError`` if the other end has gone."""
    (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise ConnectionError(f"message header of {length} bytes: the stream is corrupt")
    header = msgpack.unpackb(_read(sock, length))
    specs = header.pop("tensors")
    sizes = [math.prod(shape) * dtype(name).itemsize for _, name, shape in specs]
    payload = _read(sock, sum(sizes))
    tensors, offset = {}, 0
    for (key, name, shape), size in zip(specs, sizes):
        tensors[key] = np.frombuffer(payload, dtype=dtype(name).numpy, count=math.prod(shape),
                                     offset=offset).reshape(shape)
        offset += size
    return header, tensors


def _read(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view:
        received = sock.recv_into(view)
        if received == 0:
            raise EOFError("the other end closed the connection")
        view = view[received:]
    return buffer
