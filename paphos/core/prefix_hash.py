"""Prefix-cache block hashes: the key under which a full KV block can be found again.

Data flow: the KV cache manager calls `compute_block_hashes` on a request before it looks up the
prefix cache (admission) and after it allocates slots (to register blocks that became full). The
hash of block i chains the hash of block i-1 with block i's token ids and extra keys (LoRA id, ...),
so equal hashes mean equal *whole prefixes*, not just equal blocks.

Why sha256 (truncated to 64 bits) rather than Python's `hash()` of a tuple:
- `hash()` of ints/tuples is not a cryptographic hash; colliding token sequences can be built on
  purpose, and a collision serves one request another prefix's KV (wrong output, or a leak between
  users of a shared server). sha256 makes that infeasible; 64 bits keep the dict keys small ints
  with a negligible accidental collision rate (~n^2 / 2^65: 3e-8 at a million cached blocks).
- It is deterministic across processes and Python versions (no PYTHONHASHSEED), so the cache keys
  stay valid if the engine core moves to its own process.
The cost is about a microsecond per 16-token block, paid once per block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paphos.request import Request

# Parent tag for the first block of a sequence; distinct from any 8-byte parent encoding.
_ROOT = b"R"


def hash_block_tokens(
    parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
) -> int:
    """Hash of one full block given its parent's hash (None for the first block of a sequence).

    The byte layout is unambiguous: a root tag or the parent's 8 bytes, the token count, the token
    ids as int64, then the extra keys' repr. Different parent chains therefore never share an
    encoding, and equal inputs always give the same value within and across processes.
    """
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(_ROOT)
    else:
        h.update(b"P" + parent_hash.to_bytes(8, "little", signed=False))
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        # repr of ints/strs/tuples is stable; extra keys are identifiers such as a LoRA id.
        h.update(repr(tuple(extra_keys)).encode())
    return int.from_bytes(h.digest()[:8], "little", signed=False)


def compute_block_hashes(
    request: Request, block_size: int, extra_keys: tuple[Hashable, ...] = ()
) -> list[int]:
    """Extend `request.block_hashes` to cover every full block of `request.all_token_ids`.

    Incremental: blocks already hashed are not hashed again (a request's known tokens only ever
    grow, also across preemption). Returns the request's (updated) list.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
