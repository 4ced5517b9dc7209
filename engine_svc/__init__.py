"""tandem's engine service: token ids in, token ids out (scheduler, KV cache, workers, models).

It never imports `frontend_svc`; the offline in-process API that composes both lives in `entrypoints`.
"""
