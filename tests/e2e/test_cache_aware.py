"""Cache-aware routing over real processes: the session's two engines (`cluster`), and two frontends of
this module's own that run without --model (their tokenizer comes from the engines) and route by the
engines' KV-cache events.

Which engine holds a conversation is read from what it reports back: a turn's `cached_prompt_tokens`
equals every full block of the previous turn's prompt and output exactly when the turn ran on the engine
that computed them. Each frontend's view of each engine's cache is read from its /metrics
(`tandem_engine_cached_blocks{engine=...}`).
"""

from __future__ import annotations

import random
import re
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import collect
from tests.support import DeadlineClient, Service, free_port, wait_until

pytestmark = pytest.mark.slow

BLOCK = 16
SYSTEM = [random.Random(7).randrange(3, 500) for _ in range(32)]
REPLY_TOKENS = 8
LONG_TOKENS = 200  # still running when its engine is killed (seconds on CPU)


class Frontend:
    """A cache-aware frontend without --model, with its own metrics port."""

    def __init__(self, cluster: Any) -> None:
        self.metrics_port = free_port()
        port = free_port()
        engines = ",".join(e.address for e in cluster.engines)
        self.service = Service("frontend-cache-aware", [
            sys.executable, "-m", "frontend_svc.cli", "--engine", engines, "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", str(self.metrics_port), "--routing", "cache-aware",
            "--tokenizer-fetch-timeout", "60"], port, cluster.log_dir).start()
        self.client: DeadlineClient | None = None

    def cached_blocks(self) -> dict[str, float]:
        """engine address -> the blocks this frontend believes it has cached."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        pattern = r'^tandem_engine_cached_blocks\{engine="([^"]+)",model_name="[^"]*"\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.fixture()
def frontends(cluster: Any) -> Iterator[list[Frontend]]:
    cluster.heal()
    started = [Frontend(cluster), Frontend(cluster)]
    try:
        for f in started:
            f.service.wait_serving()
            f.client = DeadlineClient(f.service.address)
        cluster.wait_frontends_see(2, [f.service for f in started])
        yield started
    finally:
        for f in started:
            if f.client is not None:
                f.client.close()
            f.service.stop()


class Conversation:
    """A chat as token ids: a system prompt (the shared one by default), then user turns and their replies."""

    def __init__(self, seed: int, system: list[int] = SYSTEM) -> None:
        self.rng = random.Random(seed)
        self.history = list(system)
        self.computed = 0  # tokens of `history` whose K/V the engine that ran the last turn holds

    def turn(self, frontend: Frontend) -> int:
        """Send the next turn through `frontend`; returns its cached prompt tokens."""
        prompt = self.history + [self.rng.randrange(3, 500) for _ in range(12)]
        assert frontend.client is not None
        out = collect(frontend.client.generate(token_ids=prompt, temperature=0, max_tokens=REPLY_TOKENS,
                                               ignore_eos=True))[0]
        self.history = prompt + list(out["token_ids"])
        self.computed = len(self.history) - 1  # the last reply token was sampled, never computed
        return int(out["usage"].cached_prompt_tokens)

    @property
    def expected_hit(self) -> int:
        """The cached tokens of the next turn if it runs where the last one did."""
        return self.computed // BLOCK * BLOCK


def queries(cluster: Any) -> list[int]:
    return [cluster.load(i).prefix_cache_queries for i in range(len(cluster.engines))]


def test_replicas_keep_each_conversation_where_its_history_is_cached(cluster: Any,
                                                                     frontends: list[Frontend]) -> None:
    conversations = [Conversation(seed) for seed in range(6)]
    for c in conversations:
        c.turn(frontends[0])
    for turn in range(1, 4):
        for i, c in enumerate(conversations):
            expected = c.expected_hit
            # The turns alternate frontends: each replica finds the engine the other one used.
            assert c.turn(frontends[(i + turn) % 2]) == expected, f"conversation {i} turn {turn} moved"
    views = [f.cached_blocks() for f in frontends]
    assert views[0] == views[1] and sum(views[0].values()) > 0, "the replicas see the same caches"


def test_a_killed_engine_leaves_every_index_its_conversations_move_and_a_restart_is_used_again(
        cluster: Any, frontends: list[Frontend]) -> None:
    conversations = [Conversation(100 + seed) for seed in range(4)]
    before = queries(cluster)
    for i, c in enumerate(conversations):
        c.turn(frontends[i % 2])
    home = max(range(2), key=lambda e: queries(cluster)[e] - before[e])  # idle engines: one takes them all
    dead, survivor = cluster.engines[home].address, cluster.engines[1 - home].address
    for f in frontends:
        wait_until(lambda f=f: f.cached_blocks().get(dead, 0) > 0, 10, "the conversations' engine is known")

    assert frontends[0].client is not None
    running = frontends[0].client.generate(token_ids=conversations[0].history + [5] * 4, temperature=0,
                                           max_tokens=LONG_TOKENS, ignore_eos=True)
    next(running)  # streaming on the conversations' engine when it dies
    cluster.engines[home].kill()
    rest = list(running)  # it goes on on the survivor (request migration)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    for f in frontends:
        wait_until(lambda f=f: f.cached_blocks().get(dead) == 0, 10, "the dead engine's cache forgotten")
    for i, c in enumerate(conversations):  # every conversation goes on, on the survivor: its history is gone,
        lost = c.expected_hit  # but for conversation 0's, which the moved request computed there again
        if i == 0:
            assert c.turn(frontends[i % 2]) > len(SYSTEM)
        else:
            assert c.turn(frontends[i % 2]) <= len(SYSTEM) < lost
    for i, c in enumerate(conversations):  # and stays there
        expected = c.expected_hit
        assert c.turn(frontends[(i + 1) % 2]) == expected
    assert all(f.cached_blocks()[survivor] > 0 for f in frontends)

    cluster.restart_engine(home)
    cluster.wait_frontends_see(2, [f.service for f in frontends])
    for f in frontends:
        assert f.cached_blocks()[dead] == 0, "a restarted engine starts with an empty view"
    before = queries(cluster)
    fresh = Conversation(999, system=[random.Random(8).randrange(3, 500) for _ in range(32)])
    fresh.turn(frontends[1])  # nothing of it cached anywhere, loads equal: the engine caching least takes it
    assert queries(cluster)[home] > before[home], "the restarted engine was not routed to"
    expected = fresh.expected_hit
    assert fresh.turn(frontends[0]) == expected, "the other replica found it there too"
    for f in frontends:
        wait_until(lambda f=f: f.cached_blocks()[dead] > 0, 10, "its new blocks seen by every frontend")
