"""The content fingerprint of a PEFT adapter directory: what keys its KV in the prefix cache.

`adapter_fingerprint(path)` is the hex SHA-256 of the adapter's two files (`adapter_config.json`, then
`adapter_model.safetensors`), each framed by its name and byte length, so:
- two engines (or two names) serving the same files get the same fingerprint, and a frontend that learns
  it from an engine (EngineInfo.lora_adapter_infos) hashes an adapter prompt's blocks exactly as the
  engine does (shared_runtime.kv_hash.lora_extra_keys);
- other weights or another config (a name loaded again in place) give another fingerprint, so KV
  computed under the old weights is never reused.
It reads both files whole (in chunks), so it runs where reading the adapter runs: off the step loop for
a run-time load, at start for --lora-modules.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine_svc.lora.peft_dir import CONFIG_FILE, WEIGHTS_FILE

_DOMAIN = b"tandem.lora.fingerprint.v1"
_CHUNK = 1 << 20


def adapter_fingerprint(path: str | Path) -> str:
    """Hex SHA-256 over the adapter directory's config and weights files. Raises OSError when one is
    missing or unreadable (the adapter is refused before this is asked)."""
    digest = hashlib.sha256(_DOMAIN)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = Path(path) / name
        digest.update(name.encode() + b"\0" + file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
