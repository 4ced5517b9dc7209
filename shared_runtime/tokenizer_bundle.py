"""The tokenizer archive an engine serves (`GetTokenizer`) and a frontend started without --model reads.

The archive is a zip file holding, at its root, a model's tokenizer files under fixed names (`FILE_NAMES`):
a Hugging Face directory's tokenizer.json, tokenizer_config.json, chat template and the config files a
frontend reads its limits from, or `GGUF_NAME`, a GGUF file's metadata without its tensors. Its bytes
depend only on the files' names and contents: members are stored (not compressed), sorted by name, with
a fixed timestamp and fixed attributes. So two engines serving the same files send the same bytes and the
same SHA-256, which is how frontends check that every engine serves the same tokenizer.

`unpack` is the receiving side's guard: the archive must be within `MAX_ARCHIVE_BYTES`, match its
checksum, and hold only known names (nothing is ever extracted under a name the archive chooses).
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Mapping

GGUF_NAME = "tokenizer.gguf"
FILE_NAMES = frozenset({
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json", "generation_config.json",
    "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", GGUF_NAME,
})
MAX_ARCHIVE_BYTES = 256 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024  # per TokenizerChunk message: far below the 4 MiB message limit
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time zip can store


class BundleError(ValueError):
    """An archive that is too large, corrupt, does not match its checksum, or holds unknown names."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(files: Mapping[str, bytes]) -> bytes:
    """The archive of `files` (name -> contents); the same files always give the same bytes."""
    unknown = set(files) - FILE_NAMES
    if unknown:
        raise BundleError(f"not tokenizer files: {', '.join(sorted(unknown))}")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.create_system = 3  # unix, whatever the platform
            info.external_attr = 0o644 << 16
            archive.writestr(info, files[name])
    return out.getvalue()


def unpack(data: bytes, sha256: str) -> dict[str, bytes]:
    """The files of an archive received with checksum `sha256`; BundleError if anything is off."""
    if len(data) > MAX_ARCHIVE_BYTES:
        raise BundleError(f"the tokenizer archive is {len(data)} bytes, more than {MAX_ARCHIVE_BYTES}")
    actual = sha256_hex(data)
    if actual != sha256:
        raise BundleError(f"the tokenizer archive's SHA-256 is {actual}, but the engine announced {sha256}")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            unknown = sorted(set(names) - FILE_NAMES)
            if unknown or len(set(names)) != len(names):
                raise BundleError(f"the tokenizer archive holds unexpected entries: {', '.join(unknown) or names}")
            return {name: archive.read(name) for name in names}
    except zipfile.BadZipFile as exc:
        raise BundleError(f"the tokenizer archive is not a zip file: {exc}") from None


def differences(a: Mapping[str, bytes], b: Mapping[str, bytes]) -> list[str]:
    """The file names whose presence or contents differ between two unpacked archives, sorted."""
    return sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name))
