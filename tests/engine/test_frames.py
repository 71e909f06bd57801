"""torch <-> Payload round trips, through the real wire format where a message carries the
dtype (activations: float32/float16/bfloat16; prompts: int32), zero-copy on the CPU path."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import zmq

torch = pytest.importorskip("torch")

from zmqllm.bus.messages import Activation, Open  # noqa: E402
from zmqllm.bus.protocol import decode, encode  # noqa: E402
from zmqllm.bus.wire_types import Payload, ProtocolError  # noqa: E402
from zmqllm.engine.frames import (  # noqa: E402
    FLOAT16_MAX,
    activation_dtype,
    cast_for_wire,
    payload_to_tensor,
    tensor_to_payload,
)

pytestmark = pytest.mark.torch

_WIRE = [torch.float32, torch.float16, torch.bfloat16]  # what an ACTIVATION may carry
_DTYPES = [*_WIRE, torch.int32, torch.int64, torch.bool]


def _sample(dtype: Any, shape: tuple[int, ...] = (4, 8)) -> Any:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=dtype)


def _address(buf: Any) -> int:
    addr: int = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
    return addr


def _activation(p: Payload) -> Activation:
    return Activation(session="s", step=2, hidden=p)


def _hidden(frames: Any) -> Payload:
    msg = decode(frames)
    assert isinstance(msg, Activation)
    return msg.hidden


@pytest.mark.parametrize("dtype", _WIRE, ids=str)
def test_round_trip_over_zmq_is_exact_and_zero_copy(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], dtype: Any
) -> None:
    sender, receiver = pair
    src = _sample(dtype, (16, 512))
    sender.send_multipart(encode(_activation(tensor_to_payload(src))), copy=False)
    frames = receiver.recv_multipart(copy=False)
    out = payload_to_tensor(_hidden(frames))
    assert out.dtype == src.dtype
    assert out.shape == src.shape
    assert torch.equal(out, src)
    assert out.data_ptr() == _address(frames[1].buffer)


@pytest.mark.parametrize("dtype", _WIRE, ids=str)
def test_round_trip_bytes_frames(dtype: Any) -> None:
    src = _sample(dtype)
    frames = [bytes(f) for f in encode(_activation(tensor_to_payload(src)))]
    out = payload_to_tensor(_hidden(frames))
    assert torch.equal(out, src)
    assert out.data_ptr() == _address(frames[1])


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_round_trip_through_a_frame_buffer(dtype: Any) -> None:
    # Every dtype the conversion knows, read back from a frame's bytes as decode does.
    src = _sample(dtype)
    p = tensor_to_payload(src)
    buf = bytes(memoryview(p.array.reshape(-1).view(np.uint8)))
    q = Payload(np.frombuffer(buf, p.array.dtype).reshape(p.array.shape), p.dtype)
    out = payload_to_tensor(q)
    assert out.dtype == src.dtype
    assert torch.equal(out, src)
    assert out.data_ptr() == _address(buf)


def test_int32_token_ids() -> None:
    ids = torch.tensor([1, 415, 32000, 7], dtype=torch.int32)
    p = tensor_to_payload(ids)
    assert p.dtype == "int32"
    msg = decode(encode(Open(session="s", max_tokens=8, prompt_len=4, stop_ids=(2,), tokens=p)))
    assert isinstance(msg, Open) and msg.tokens is not None
    assert torch.equal(payload_to_tensor(msg.tokens), ids)


def test_bfloat16_bits_exact() -> None:
    words = torch.tensor([[0x3F80, -0x4000, 0x7F80, 0x7FC1, 0x0001]], dtype=torch.int16)
    src = words.view(torch.bfloat16)
    p = tensor_to_payload(src)
    assert p.dtype == "bfloat16"
    assert p.array.dtype == np.uint16
    out = payload_to_tensor(_hidden(encode(_activation(p))))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), words)  # NaN included: compare the bits


def test_tensor_to_payload_shares_memory() -> None:
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    p = tensor_to_payload(src)
    assert p.array.__array_interface__["data"][0] == src.data_ptr()


def test_non_contiguous_tensor_is_copied_contiguous() -> None:
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    p = tensor_to_payload(src)
    assert p.array.flags.c_contiguous
    assert torch.equal(payload_to_tensor(_hidden(encode(_activation(p)))), src)


def test_requires_grad_tensor() -> None:
    src = torch.ones(3, requires_grad=True)
    assert torch.equal(payload_to_tensor(tensor_to_payload(src)), src.detach())


def test_zero_size_and_scalar() -> None:
    for src in (torch.empty(0, 4096, dtype=torch.bfloat16), torch.tensor(3.5)):
        out = payload_to_tensor(tensor_to_payload(src))
        assert out.shape == src.shape
        assert torch.equal(out, src)


def test_read_only_payload_does_not_warn() -> None:
    frames = [bytes(f) for f in encode(_activation(tensor_to_payload(torch.ones(1, 4))))]
    q = _hidden(frames)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        payload_to_tensor(q)


def test_no_payload_warns_in_a_fresh_process() -> None:
    """torch warns once per process about a non-writable array: neither the first
    read-only payload (after a writable one) nor any later one may show it."""
    code = """
import numpy as np
from zmqllm.engine.frames import payload_to_tensor
from zmqllm.bus.protocol import Payload
payload_to_tensor(Payload(np.ones(4, np.float32), "float32"))  # writable: nothing to say
for _ in range(3):
    ro = np.frombuffer(bytes(16), np.float32)
    assert not ro.flags.writeable
    assert payload_to_tensor(Payload(ro, "float32")).shape == (4,)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_unsupported_dtype() -> None:
    with pytest.raises(ProtocolError):
        tensor_to_payload(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ProtocolError):
        payload_to_tensor(Payload(np.zeros(2, np.float32), "int32"))


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_wire_dtype_travels_as_its_name_in_half_the_bytes(name: str) -> None:
    dtype = activation_dtype(name)
    src = _sample(torch.float32, (16, 512))
    sent = cast_for_wire(src, dtype)
    p = tensor_to_payload(sent)
    assert p.dtype == name
    assert p.array.nbytes == src.numel() * (4 if name == "float32" else 2)
    got = payload_to_tensor(_hidden(encode(_activation(p))))
    assert got.dtype == dtype
    # What arrives is float32's value rounded once to the wire dtype, nothing else.
    assert torch.equal(got, src.to(dtype))


def test_no_wire_dtype_sends_the_tensor_itself() -> None:
    src = _sample(torch.float32)
    assert cast_for_wire(src, None) is src
    assert cast_for_wire(src, torch.float32) is src


def test_float16_saturates_instead_of_overflowing() -> None:
    src = torch.tensor([[1e6, -1e6, 70000.0, 1.5, float("nan")]])
    sent = cast_for_wire(src, torch.float16)
    assert sent.dtype == torch.float16
    assert sent[0, :3].tolist() == [FLOAT16_MAX, -FLOAT16_MAX, FLOAT16_MAX]
    assert sent[0, 3].item() == 1.5
    assert torch.isnan(sent[0, 4])  # a NaN stays one: it was already poison
    assert not torch.isinf(cast_for_wire(src, torch.bfloat16)[0, :3]).any()  # float32's range


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip() -> None:
    src = _sample(torch.bfloat16).cuda()
    out = payload_to_tensor(_hidden(encode(_activation(tensor_to_payload(src)))), device="cuda")
    assert out.device.type == "cuda"
    assert torch.equal(out, src)
