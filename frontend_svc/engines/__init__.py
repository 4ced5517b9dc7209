"""The frontend's links to its engines: one `Connect` stream per engine (client.py), which engine a request
goes to (router.py, kv_index.py: cache-aware routing on each engine's KV events), and how an engine stream
is paced by the readers of its output (drain_gate.py). Transport and routing only: the requests themselves
are owned by the dispatcher (frontend_svc/dispatcher.py)."""
