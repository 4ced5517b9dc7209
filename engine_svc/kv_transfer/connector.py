"""The scheduler side of the connector: which blocks a finished prefill keeps, which blocks a request
pulls before it runs, and what a failed pull turns into.

Producer (`do_remote_decode`): a request that finishes by length keeps its block table under a lease
(leases.py) instead of freeing it; its last output carries `kv_transfer_params` naming this engine, the
request and its blocks. Any other finish (a stop token, an abort, an error) frees the blocks as usual.

Consumer (`do_remote_prefill`): on arrival the request looks up its prompt in the prefix cache and pulls
only the blocks after the hit (`start_load`), waiting meanwhile in WAITING_FOR_REMOTE_KVS, holding no
block. When the pull ends (`take_loaded`) it joins `waiting` with the bytes (or, under the `recompute`
policy, without them after a failure); at admission `plan_load` says how many tokens the bytes add to the
prefix-cache hit, and which of the freshly allocated blocks they fill: the step that admits the request
writes them (`KVBlockLoad`) before its forward pass, so the request computes only what is left - at
least its last token, whose logits it samples from. Blocks pulled but evicted from the hit meanwhile leave
a gap: the bytes are dropped and the request computes from its (smaller) hit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_svc.kv_transfer.blocks import staging_buffer
from engine_svc.kv_transfer.config import KVTransferConfig
from engine_svc.kv_transfer.leases import LeaseTable
from engine_svc.kv_transfer.puller import KVPuller, PullResult
from engine_svc.kv_transfer.source import HostBuffer, ReadBlocks
from engine_svc.request import Request, RequestStatus
from shared_runtime.contract import KvTransferParams

if TYPE_CHECKING:
    from engine_svc.kv_transfer.blocks import BlockViews, CacheLayout
    from engine_svc.kv_transfer.side_channel import SideChannelServer


@dataclass(frozen=True)
class LoadPlan:
    """What an admission takes from a pull: `num_tokens` computed tokens beyond the prefix-cache hit,
    written into the request's `num_blocks` blocks from `first_block` on (`data`: those blocks' bytes, a
    view of the pull's buffer, not a copy)."""

    num_tokens: int
    first_block: int
    data: memoryview
    num_blocks: int = 0


_NOTHING = memoryview(b"")


def plan_load(load: PullResult, num_hit_tokens: int, num_tokens: int, block_size: int) -> LoadPlan:
    """The part of `load` an admission with a prefix-cache hit of `num_hit_tokens` (whole blocks) can use.
    The request keeps at least its last token to compute; nothing is usable when the hit ends before the
    pulled blocks start."""
    hit_blocks = num_hit_tokens // block_size
    if load.data is None or not load.num_blocks or hit_blocks < load.first_block:
        return LoadPlan(0, hit_blocks, _NOTHING)
    end_block = load.first_block + load.num_blocks
    target = min(load.num_tokens, num_tokens - 1, end_block * block_size)
    if target <= num_hit_tokens:
        return LoadPlan(0, hit_blocks, _NOTHING)
    block_bytes = len(load.data) // load.num_blocks
    last = -(-target // block_size)
    data = load.data[(hit_blocks - load.first_block) * block_bytes:(last - load.first_block) * block_bytes]
    return LoadPlan(target - num_hit_tokens, hit_blocks, data, last - hit_blocks)


def _no_cache(block_ids: list[int], out: memoryview | None) -> bytes:
    raise RuntimeError("this connector has no KV cache to read")


class KVConnector:
    def __init__(self, config: KVTransferConfig, block_size: int, *, leases: LeaseTable | None = None,
                 puller: KVPuller | None = None, engine_id: str = "") -> None:
        self.config = config
        self.block_size = block_size
        self.leases = leases if config.is_producer else None
        self.puller = puller if config.is_consumer else None
        self.engine_id = engine_id
        self.host, self.port = config.kv_advertise_host, 0  # set by the server once it listens
        self.num_pulls = self.num_pull_failures = self.num_blocks_pulled = 0  # cumulative, consumer side
        # The wire bytes of the given blocks, read from the cache (on any thread; into the given buffer
        # when there is one and the cache is in this process; setup.py)
        self.read_blocks: ReadBlocks = _no_cache
        self.reads_in_pieces = True  # whether a pull reads its blocks span by span (False: all at once)
        self.host_buffer: HostBuffer = staging_buffer  # a span's staging memory (pinned for a CUDA cache)
        # Views of the cache's own memory for given blocks, in wire order, when the side channel can send
        # them as they lie (a one-rank cache in host memory: blocks.cache_views); None: the staging copy
        self.block_views: BlockViews | None = None
        self.layout: CacheLayout | None = None
        self.side_channel: SideChannelServer | None = None  # a producer's, when configured (setup.advertise)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake` is called from other threads when a pull or a lease ends (the busy loop's inbox)."""
        if self.leases is not None:
            self.leases.on_ended = wake
        if self.puller is not None:
            self.puller.on_done = wake

    def close(self) -> None:
        """The engine stops: the side channel stops listening."""
        if self.side_channel is not None:
            self.side_channel.close()

    # ---- producer ------------------------------------------------------------------------------------
    def wants_hold(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return (self.leases is not None and params is not None and params.do_remote_decode
                and request.status == RequestStatus.FINISHED_LENGTH)

    def hold(self, request: Request, block_ids: list[int]) -> KvTransferParams:
        """Keep `block_ids` (the finished request's table) under a lease; the params that name them."""
        assert self.leases is not None
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.leases.hold(request, block_ids, num_tokens)
        return KvTransferParams(remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
                                remote_request_id=request.request_id, remote_block_ids=block_ids,
                                remote_num_tokens=num_tokens)

    def holds(self, request_id: str) -> bool:
        """Whether a lease holds blocks under this id (a new request may not take it yet)."""
        return self.leases is not None and self.leases.holds(request_id)

    def release(self, request_ids: list[str]) -> None:
        """Abort: end the leases of these ids (ids without one are ignored)."""
        if self.leases is not None:
            for request_id in request_ids:
                self.leases.release(request_id)

    def take_ended(self) -> list[Request]:
        return self.leases.take_ended() if self.leases is not None else []

    # ---- consumer ------------------------------------------------------------------------------------
    def wants_load(self, request: Request) -> bool:
        """Whether to pull for this request: it names a producer, and needs nothing a pull cannot give
        (prompt logprobs need every prompt position computed here)."""
        params = request.kv_transfer_params
        return (self.puller is not None and params is not None and params.do_remote_prefill
                and bool(params.remote_host) and request.sampling_params.prompt_logprobs is None)

    def start_load(self, request: Request, num_hit_tokens: int) -> None:
        """Pull the producer's blocks after the prefix-cache hit (`num_hit_tokens`, whole blocks)."""
        assert self.puller is not None and request.kv_transfer_params is not None
        self.num_pulls += 1
        self.puller.start(request.request_id, request.kv_transfer_params, num_hit_tokens // self.block_size,
                          request.lora_name)

    def cancel_load(self, request_id: str) -> None:
        if self.puller is not None:
            self.puller.cancel(request_id)

    def take_loaded(self) -> list[PullResult]:
        if self.puller is None:
            return []
        done = self.puller.take_done()
        for result in done:
            if result.data is None:
                self.num_pull_failures += 1
            else:
                self.num_blocks_pulled += result.num_blocks
        return done

    @property
    def recompute_on_failure(self) -> bool:
        return self.config.kv_load_failure_policy == "recompute"

    def has_ready(self) -> bool:
        """Whether the scheduler has something to do for the connector now (a pull ended, a lease ended)."""
        return ((self.puller is not None and self.puller.has_done())
                or (self.leases is not None and self.leases.has_ended()))
