"""bench/frontend_capacity.py's `--variant` hook: adds gRPC server options to the frontend's public server.

Put on PYTHONPATH (so Python imports it at startup) with FRONTEND_CAPACITY_GRPC_OPTIONS set to a JSON
list of [name, value] pairs; the frontend then builds its public server with these followed by
`server_options(config)` (grpc keeps the FIRST pair of a name, so these win). Benchmark-only: lets a
bench run try a grpc channel argument without a frontend flag for it.
"""

import json
import os
from typing import Any

_extra = json.loads(os.environ.get("FRONTEND_CAPACITY_GRPC_OPTIONS", "[]"))
if _extra:
    import frontend_svc.server as _server

    _base = _server.server_options

    def _with_extra(config: Any) -> list[tuple[str, Any]]:
        return [*((name, value) for name, value in _extra), *_base(config)]

    _server.server_options = _with_extra
