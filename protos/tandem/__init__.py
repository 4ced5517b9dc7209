"""tandem's protobuf contracts: `tandem.v1` (public API), `tandem.engine.v1` (frontend <-> engine)
and `tandem.vendor.smg` (SMG's `vllm.grpc.engine.VllmEngine`, vendored: see the header of its .proto files).

Only `.proto` files and the code `scripts/gen_protos.py` generates from them live here; the hand-written
runtime code both services share is the `shared_runtime` package.
"""
