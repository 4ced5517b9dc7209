"""Prefill/decode disaggregation: K/V blocks moved between engines over tandem's engine gRPC.

vLLM V1's KV-connector shape, with one connector (`GrpcConnector`): a scheduler side (`connector.py`:
which blocks a finished prefill keeps under a lease, which blocks a request must pull before it runs)
and a worker side (`blocks.py`: the bytes of blocks read from and written into the paged cache). The
producer serves `EngineCoreService/PullKvBlocks` (engine_svc/api/kv_pull.py); the consumer pulls on its
own threads (`puller.py`) into host memory and hands the bytes to the worker with the step that admits the
request. With TP/PP > 1 each rank holds a shard of every block (`shards.py`: gathered to the answer rank
for a pull, sliced by each rank for a write). The producer reads a pull's blocks span by span
(`source.py`), each span's CRC-32 checked by the consumer (`checksum.py`). A producer with a side channel
(`side_channel.py`) sends the bytes of a plaintext pull over plain TCP, gRPC keeping the control.
"""
