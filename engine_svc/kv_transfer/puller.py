"""The consumer's pulls: one thread per pull, each a `PullKvBlocks` stream from the producer into one
host buffer of the pull's size (chunk by chunk from the stream, or straight from the side channel),
checked (block count, byte count, each span's CRC-32: checksum.py) before the scheduler may use it.

Every `start` ends in exactly one `PullResult` in `take_done` (bytes, or an error saying why), unless it
was cancelled first (then nothing comes). `on_done` is called from the pull's thread when a result is
ready: a wake-up for the scheduler's thread. The call carries the engine token as a bearer token when
one is given (engines in one deployment share it), over TLS when the engine serves TLS (`credentials`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy
from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.engine.v1 import engine_core_pb2_grpc as pb_grpc

from engine_svc.kv_transfer.blocks import CacheLayout
from engine_svc.kv_transfer.checksum import SpanSums, first_mismatch
from engine_svc.kv_transfer.side_channel import receive
from shared_runtime.contract import KvTransferParams


@dataclass(frozen=True)
class PullResult:
    request_id: str
    first_block: int  # the first block of the producer's table the data starts at
    num_tokens: int  # tokens whose K/V the producer's whole table holds
    data: memoryview | None  # a writable buffer of the bytes; None when the pull failed
    error: str | None = None
    num_blocks: int = 0  # blocks in data


def layout_to_pb(layout: CacheLayout) -> pb.KvCacheLayout:
    return pb.KvCacheLayout(model_name=layout.model_name, block_size=layout.block_size, dtype=layout.dtype,
                            num_layers=layout.num_layers, block_shape=list(layout.block_shape),
                            tensor_parallel_size=layout.tensor_parallel_size, num_kv_heads=layout.num_kv_heads)


def layout_from_pb(msg: pb.KvCacheLayout) -> CacheLayout:
    return CacheLayout(msg.model_name, msg.block_size, msg.dtype, msg.num_layers, tuple(msg.block_shape),
                       msg.tensor_parallel_size, msg.num_kv_heads)


class KVPuller:
    def __init__(self, layout: CacheLayout, *, timeout_s: float, max_message_bytes: int,
                 authorization: Callable[[], str] | None = None, on_done: Callable[[], None] = lambda: None) -> None:
        self.layout = layout
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.authorization = authorization
        # TLS to the producer (an engine serving TLS pulls over TLS: `pull_credentials`), else plaintext
        self.credentials: Callable[[], grpc.ChannelCredentials] | None = None
        self.ssl_server_name = ""  # under TLS, the name the producer's certificate must carry ("": its host)
        self.offer_side_channel = True  # offer the producer's side channel when pulling in plaintext
        self.on_done = on_done
        self._lock = threading.Lock()
        self._calls: dict[str, Any] = {}  # request id -> its call (None until it started), while pulling
        self._done: list[PullResult] = []

    def start(self, request_id: str, params: KvTransferParams, first_block: int, lora_name: str = "") -> None:
        """Pull in a thread the producer's blocks from `first_block` on, for a request running under the
        adapter `lora_name` (the producer refuses K/V computed under another)."""
        with self._lock:
            self._calls[request_id] = None  # before the thread: a cancel from now on is seen
        threading.Thread(target=self._pull, args=(request_id, params, first_block, lora_name), daemon=True,
                         name=f"kv-pull {request_id}").start()

    def cancel(self, request_id: str) -> None:
        """Drop the pull (its result never comes); the producer frees the blocks when the stream ends."""
        with self._lock:
            call = self._calls.pop(request_id, None)
        if call is not None:
            call.cancel()

    def take_done(self) -> list[PullResult]:
        with self._lock:
            done, self._done = self._done, []
            return done

    def has_done(self) -> bool:
        with self._lock:
            return bool(self._done)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._calls)

    def pull_now(self, request_id: str, params: KvTransferParams, first_block: int, lora_name: str = "") -> PullResult:
        """One pull on the calling thread, outside the scheduler's bookkeeping (tools, benchmarks)."""
        with self._lock:
            self._calls[request_id] = None
        try:
            return self._guarded(request_id, params, first_block, lora_name)
        finally:
            with self._lock:
                self._calls.pop(request_id, None)

    def _guarded(self, request_id: str, params: KvTransferParams, first_block: int, lora_name: str) -> PullResult:
        """`_fetch`, its failures turned into a result: never raises."""
        try:
            return self._fetch(request_id, params, first_block, lora_name)
        except grpc.RpcError as exc:
            return PullResult(request_id, first_block, 0, None,
                              f"pull from {params.remote_host}:{params.remote_port} failed: "
                              f"{exc.code().name}: {exc.details()}")
        except Exception as exc:  # any failure of a pull is the request's, never the engine's
            return PullResult(request_id, first_block, 0, None, f"pull failed: {type(exc).__name__}: {exc}")

    def _pull(self, request_id: str, params: KvTransferParams, first_block: int, lora_name: str) -> None:
        result = self._guarded(request_id, params, first_block, lora_name)
        with self._lock:
            if self._calls.pop(request_id, "cancelled") == "cancelled":
                return
            self._done.append(result)
        self.on_done()

    def _request(self, remote_request_id: str, first_block: int, lora_name: str) -> pb.PullKvBlocksRequest:
        """The pull's request: the side channel is offered only when the pull itself is plaintext."""
        return pb.PullKvBlocksRequest(request_id=remote_request_id, first_block=first_block,
                                      layout=layout_to_pb(self.layout), lora_name=lora_name,
                                      accept_side_channel=self.offer_side_channel and self.credentials is None)

    def _fetch(self, request_id: str, params: KvTransferParams, first_block: int, lora_name: str) -> PullResult:
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", self.max_message_bytes)]
        metadata = [("authorization", self.authorization())] if self.authorization is not None else []
        request = self._request(params.remote_request_id, first_block, lora_name)
        target = f"{params.remote_host}:{params.remote_port}"
        if self.credentials is None:
            channel = grpc.insecure_channel(target, options=options)
        else:
            if self.ssl_server_name:
                options.append(("grpc.ssl_target_name_override", self.ssl_server_name))
            channel = grpc.secure_channel(target, self.credentials(), options=options)
        with channel:
            call = pb_grpc.EngineCoreServiceStub(channel).PullKvBlocks(request, timeout=self.timeout_s,
                                                                      metadata=metadata)
            with self._lock:
                if request_id not in self._calls:
                    call.cancel()
                    return PullResult(request_id, first_block, 0, None, "cancelled")
                self._calls[request_id] = call
            size = got = num_tokens = 0
            sent_crcs: list[int] = []
            side = False
            buffer = memoryview(bytearray())
            sums: SpanSums | None = None
            with contextlib.ExitStack() as stack:  # the sums' thread ends with the pull, however it ends
                for chunk in call:
                    if sums is None:  # the first chunk: the counts
                        size = chunk.num_blocks * self.layout.block_bytes
                        num_tokens = chunk.num_tokens
                        buffer = numpy.empty(size, dtype=numpy.uint8).data  # unzeroed: every byte is written
                        sums = stack.enter_context(SpanSums(buffer, chunk.checksum_span_bytes))
                    if chunk.side_ticket and not side:  # the bytes over the producer's side channel
                        receive(params.remote_host, chunk.side_port, chunk.side_ticket, buffer, self.timeout_s, sums)
                        side, got = True, size
                    if chunk.data:
                        if side or got + len(chunk.data) > size:
                            raise ValueError(f"the producer sent more than the {size} bytes of "
                                             f"{size // self.layout.block_bytes} blocks")
                        buffer[got:got + len(chunk.data)] = chunk.data
                        got += len(chunk.data)
                        sums.arrived(got)
                    sent_crcs = list(chunk.span_crc32) or sent_crcs
        if sums is None:
            raise ValueError("the producer's stream ended before its first chunk")
        if got != size:
            raise ValueError(f"the producer sent {got} bytes for {size // self.layout.block_bytes} blocks, "
                             f"expected {size}")
        problem = first_mismatch(sums.crcs, sent_crcs, sums.span_bytes, size)
        if problem is not None:
            raise ValueError(problem)
        return PullResult(request_id, first_block, num_tokens, buffer, None, size // self.layout.block_bytes)
