"""torch.Tensor <-> protocol.Payload without copying on the CPU path.

Only workers import this module (it needs torch); the wire format itself lives in
zmqllm.bus.protocol, which stays torch-free.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from zmqllm.bus.wire_types import WIRE_DTYPES, Payload, ProtocolError

# bfloat16 is absent: numpy has no bf16, so it takes the int16-view path below.
_WIRE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}

# The dtypes activations may travel in (what messages.Activation accepts), by wire name.
ACTIVATION_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
_BY_NAME = {name: dtype for dtype, name in ACTIVATION_DTYPES.items()}
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def activation_dtype(name: str) -> torch.dtype:
    """The torch dtype of an activation wire dtype name ("float32", "bfloat16", "float16")."""
    return _BY_NAME[name]


def cast_for_wire(hidden: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Hidden states as they are sent: ``dtype`` (None: as they are). float16 saturates
    at its largest finite value instead of becoming inf, which would turn every later
    stage's output into NaN; bfloat16 has float32's range."""
    if dtype is None or hidden.dtype == dtype:
        return hidden
    if dtype == torch.float16:
        hidden = hidden.clamp(-FLOAT16_MAX, FLOAT16_MAX)
    return hidden.to(dtype)


def tensor_to_payload(t: torch.Tensor) -> Payload:
    """Wrap a tensor's memory as a Payload for protocol.encode.

    A contiguous CPU tensor is shared, not copied: do not write to it until zmq has sent
    the frame. A GPU tensor is copied to the CPU first, and a non-contiguous one is copied
    into a contiguous tensor (both unavoidable: the frame must be one host buffer).
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        # Same 2-byte words reinterpreted: int16 has a numpy twin, then uint16 is the
        # carrier dtype the protocol expects for "bfloat16".
        return Payload(t.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    name = _WIRE_NAMES.get(t.dtype)
    if name is None:
        raise ProtocolError(f"torch dtype {t.dtype} has no wire dtype")
    return Payload(t.numpy(), name)


def payload_to_tensor(p: Payload, device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor over a decoded payload's memory (CPU: no copy; other devices: one copy).

    Decoded payloads view read-only zmq frames, so the CPU tensor must be treated as
    read-only too: writing to it is undefined. Clone it to get a writable tensor.
    """
    arr = p.array
    if WIRE_DTYPES.get(p.dtype) != arr.dtype:
        raise ProtocolError(f"array of {arr.dtype} cannot be read as {p.dtype!r}")
    if p.dtype == "bfloat16":
        arr = arr.view(np.int16)  # torch.from_numpy has no bf16; reinterpret after
    with warnings.catch_warnings():
        # from_numpy warns once per process about non-writable arrays; we share on purpose
        # and document the read-only contract above instead.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        t = torch.from_numpy(arr)
    if p.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t if torch.device(device).type == "cpu" else t.to(device)
