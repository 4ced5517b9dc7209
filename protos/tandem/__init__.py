"""tandem's protobuf contracts: `tandem.v1` (public API) and `tandem.engine.v1` (frontend <-> engine).

Only `.proto` files and the code `scripts/gen_protos.py` generates from them live here; the hand-written
runtime code both services share is the `shared_runtime` package.
"""
