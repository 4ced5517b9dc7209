"""`--distributed-executor-backend ray`: one Ray actor per rank (TP x PP of them), placed by a placement group.

    engine process                                    Ray actors (ray_worker.RankActor), rank 0 .. N-1
    RayExecutor --ray.put(command) once, then----->   run(command) -> Worker -> (answer rank) answer
                  actor.run(ref) on every rank
                <--the answer rank's ObjectRef------

The cluster: the one this process is already connected to (ray.init() done), else the one at RAY_ADDRESS
(`ray start --head` / KubeRay), else a local one started here (and stopped at shutdown). The placement
group has one bundle per rank, {"GPU": 1} on CUDA and {"CPU": 1} on CPU, strategy PACK (vLLM's: fill a
node before the next one); when this process already runs inside a placement group, its bundles are used.
Rank r takes bundle r; rank 0's node hosts the torch.distributed rendezvous (gloo on CPU, nccl on CUDA).

Steps are plain actor calls, not vLLM's later compiled graph: every step is one `run` call per actor with
the encoded SchedulerOutput (inline when small; a large one is stored once with `ray.put` and passed by
reference). Ray runs one caller's calls on an actor
in submission order, so every rank sees every command in order (the invariant the multiproc executor's
shared-memory queue gives) and, with P pipeline stages, stage s works on step n while stage s+1 works on
step n-1: the engine core keeps P batches in flight (`max_concurrent_batches`).

Failure model: waiting for a step waits for every rank's call of that step; the first call that fails (the
actor died: RayActorError; or raised: RayTaskError) fails the engine: every actor is killed, the placement
group removed, a cluster started here stopped, and `WorkerDiedError` names the rank and the cause. While
no step runs, `check_health` pings the actors (at most once a second) so an idle death is noticed too.
Actors are owned by this process, so Ray also ends them when it exits. `shutdown()` is idempotent and runs
when the executor is garbage-collected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any, NoReturn

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine_svc.config import EngineConfig
from engine_svc.executor.base import StepFuture, WorkerInfoExecutor
from engine_svc.executor.codec import (
    CacheSpec,
    Op,
    WorkerInfo,
    decode_runner_output,
    decode_worker_info,
    encode_command,
)
from engine_svc.executor.multiproc import WorkerDiedError
from engine_svc.executor.ray_worker import RAY_CUDA_WORKER_CLS, RankActor
from engine_svc.executor.worker_proc import DEFAULT_WORKER_CLS, answer_rank
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_ENV = "TANDEM_RAY_PLACEMENT_TIMEOUT_S"
ENV_PREFIX = "TANDEM_"  # the engine's environment variables the actors get (vLLM passes its VLLM_* ones)
_PING_INTERVAL_S = 1.0
_FAILURE_POLL_S = 0.05  # while waiting for a step, how often the calls already done are checked for failures
INLINE_COMMAND_BYTES = 64 << 10  # larger commands go through the object store once (Ray inlines < 100 KiB)


def connect_ray(world_size: int, device: str) -> bool:
    """Connect this process to a Ray cluster: the current one, RAY_ADDRESS's, or a new local one with at
    least `world_size` CPUs on CPU. True when this call connected (shutdown then disconnects, which
    stops a local cluster started here)."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return True
    cpus = max(os.cpu_count() or 1, world_size) if device == "cpu" else None
    ray.init(address="local", num_cpus=cpus, include_dashboard=False)  # "local": never a stale `ray start` one
    return True


def make_placement_group(world_size: int, device: str, timeout_s: float) -> tuple[PlacementGroup, bool]:
    """(the placement group for `world_size` ranks, whether it was created here). Fails, naming what it
    needs and what the cluster has, when the bundles cannot be placed within `timeout_s`."""
    current = get_current_placement_group()
    if current is not None:
        if len(current.bundle_specs) < world_size:
            raise RuntimeError(f"this process runs in a Ray placement group of {len(current.bundle_specs)} "
                               f"bundles; the engine needs {world_size} (one per rank)")
        return current, False
    bundle = {"GPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not place {world_size} bundles of {bundle} within "
                           f"{timeout_s:.0f} s (it has {ray.cluster_resources()}); add nodes or lower "  # type: ignore[no-untyped-call]
                           "--tensor-parallel-size x --pipeline-parallel-size")
    return group, True


class RayStepFuture:
    """One EXECUTE broadcast: every rank's call; the answer rank's result is the step's output."""

    def __init__(self, executor: RayExecutor, refs: list[Any], answer_index: int) -> None:
        self._executor, self._refs, self._answer = executor, refs, answer_index
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = decode_runner_output(self._executor._gather(self._refs)[self._answer])
        return self._output

    def done(self) -> bool:
        return self._output is not None or bool(ray.wait([self._refs[self._answer]], timeout=0)[0])


class RayExecutor(WorkerInfoExecutor):
    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER_CLS) -> None:
        super().__init__(config)
        self.world_size = config.world_size
        self._answer = answer_rank(config)
        self._info: WorkerInfo | None = None
        self._failure: str | None = None
        self._fail_lock = threading.Lock()
        self._send_lock = threading.Lock()  # one broadcast at a time: every rank sees commands in one order
        self._pings: list[Any] = []
        self._last_ping = 0.0
        self._actors: list[Any] = []
        owns_ray = connect_ray(self.world_size, config.device)
        self._pg_holder: list[PlacementGroup] = []
        self._finalizer = weakref.finalize(self, _teardown, self._actors, self._pg_holder, owns_ray)
        try:
            self._start(worker_cls)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, worker_cls: str) -> None:
        timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "120"))
        group, created = make_placement_group(self.world_size, self.config.device, timeout)
        if created:
            self._pg_holder.append(group)
        if self.config.device == "cuda" and worker_cls == DEFAULT_WORKER_CLS:
            worker_cls = RAY_CUDA_WORKER_CLS
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
        actor_cls = ray.remote(RankActor)
        gpus = 1 if self.config.device == "cuda" else 0
        for rank in range(self.world_size):
            options: dict[str, Any] = dict(
                num_cpus=0 if gpus else 1, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=True))
            if env:
                options["runtime_env"] = {"env_vars": env}
            self._actors.append(actor_cls.options(**options).remote(self.config, rank, worker_cls))
        addresses = self._gather([actor.address.remote() for actor in self._actors])
        self.worker_pids = [pid for _, pid, _ in addresses]
        ip, _, port = addresses[0]
        self._gather([actor.start.remote(f"tcp://{ip}:{port}") for actor in self._actors])

    # ---- the Executor interface --------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        self._info = decode_worker_info(self._broadcast(Op.LOAD_MODEL))
        return self._info.num_blocks

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._broadcast(Op.INIT_CACHE, CacheSpec(num_blocks, max_model_len))

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        return RayStepFuture(self, self._send(Op.EXECUTE, scheduler_output), self._answer)

    def describe_kv(self) -> bytes:
        """P/D: every rank's K/V shard (engine_svc/kv_transfer/shards.py), encoded; each rank keeps its own."""
        return self._broadcast(Op.KV_DESCRIBE)

    def read_kv_blocks(self, block_ids: list[int]) -> bytes:
        """P/D: the wire bytes of `block_ids`, gathered from every rank after the steps submitted before.
        Safe to call from any thread (the engine core keeps stepping meanwhile): the command is one more
        broadcast in every actor's order, and waiting for it waits for nothing else."""
        return self._broadcast(Op.KV_READ, block_ids)

    def check_health(self) -> None:
        """Raise WorkerDiedError after a failure or shutdown, or if an actor is found dead: pings sent at
        most once a second are checked without waiting (an actor busy with a step answers later)."""
        if not self._finalizer.alive:
            raise WorkerDiedError(self._failure or "the Ray executor is shut down")
        if self._pings:
            ready, _ = ray.wait(self._pings, num_returns=len(self._pings), timeout=0)
            for ref in ready:
                self._check(ref, self._pings.index(ref))
            if len(ready) < len(self._pings):
                return
        if time.monotonic() - self._last_ping >= _PING_INTERVAL_S:
            self._last_ping = time.monotonic()
            self._pings = [actor.ping.remote() for actor in self._actors]

    def shutdown(self) -> None:
        self._finalizer()

    # ---- plumbing ----------------------------------------------------------------------------------
    def _send(self, op: Op, body: object = None) -> list[Any]:
        """Broadcast one command to every actor's `run`, in rank order: inline in each call when small (Ray
        then ships it with the call), else stored once and passed by reference (each actor fetches it).
        Broadcasts from several threads (the step loop, a P/D pull) never interleave: Ray keeps one
        caller's calls to an actor in submission order, so every actor then runs every command in one
        order and the collectives inside line up."""
        if not self._finalizer.alive:
            raise WorkerDiedError(self._failure or "the Ray executor is shut down")
        payload = bytes(encode_command(op, body))
        command = payload if len(payload) <= INLINE_COMMAND_BYTES else ray.put(payload)
        with self._send_lock:
            return [actor.run.remote(command) for actor in self._actors]

    def _broadcast(self, op: Op, body: object = None) -> bytes:
        """Broadcast one command and wait for it: the answer rank's answer."""
        return self._gather(self._send(op, body))[self._answer]  # type: ignore[no-any-return]

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's result of one call (refs in rank order), or WorkerDiedError within about
        `_FAILURE_POLL_S` of any failing (a rank's peers may block in a collective meanwhile)."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_FAILURE_POLL_S)
            if pending:  # not all done yet: fail now if one of those done failed
                for ref in ready:
                    self._check(ref, refs.index(ref))
        try:
            return ray.get(refs)
        except RayError:
            for rank, ref in enumerate(refs):
                self._check(ref, rank)
            raise

    def _check(self, ref: Any, rank: int) -> None:
        """Fail the engine if the finished call `ref` of `rank` raised or its actor died."""
        try:
            ray.get(ref)
        except RayError as exc:
            self._fail(f"rank {rank} ({type(exc).__name__}): {exc}")

    def _fail(self, reason: str) -> NoReturn:
        """Record the first failure, end every actor, raise WorkerDiedError (thread-safe)."""
        with self._fail_lock:
            if self._failure is None and self._finalizer.alive:
                self._failure = "Ray worker died: " + reason
                logger.error("%s", self._failure)
                self.shutdown()
        raise WorkerDiedError(self._failure or "the Ray executor is shut down")


def _teardown(actors: list[Any], groups: list[PlacementGroup], owns_ray: bool) -> None:
    """Kill every actor, remove the placement group made here, disconnect (stopping a local cluster
    started here). Holds no reference to the executor so it can run as its weakref finalizer."""
    if not ray.is_initialized():
        return
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
    if owns_ray:
        ray.shutdown()
