"""A cap on how many calls of one kind an engine serves at once (GetTokenizer downloads).

A download that its caller stops reading holds what was being written (a 1 MiB chunk, and grpc's send
buffers) for as long as the call stays open; without a cap, 200 such callers held +367 MB. Past the cap a
call is refused with RESOURCE_EXHAUSTED (retryable), set on the call rather than raised with
`context.abort`, whose exception grpc would keep with the handler's frame until a full collection.
"""

from __future__ import annotations

import grpc

DEFAULT_MAX_TOKENIZER_DOWNLOADS = 32  # GetTokenizer calls at once (a frontend fetches it once, at start)


class StreamCap:
    """At most `limit` calls hold a place at once; `take` returns False past it."""

    def __init__(self, what: str, flag: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be >= 1, got {limit}")
        self.what, self.flag, self.limit = what, flag, limit
        self.active = 0

    def take(self, context: grpc.aio.ServicerContext) -> bool:
        """Hold a place, or set RESOURCE_EXHAUSTED on `context` and return False."""
        if self.active >= self.limit:
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(f"this engine serves {self.limit} {self.what} calls at once ({self.flag}); "
                                "retry later")
            return False
        self.active += 1
        return True

    def give_back(self) -> None:
        self.active -= 1
