"""Chained block hashes: deterministic, parent-sensitive, incremental."""

import subprocess
import sys
from pathlib import Path

from core_fakes import make_request

from paphos.core.prefix_hash import compute_block_hashes, hash_block_tokens

REPO = Path(__file__).resolve().parents[2]


def test_deterministic_and_64_bit():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert 0 <= h < 2**64


def test_parent_chain_and_extra_keys_change_the_hash():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    other_root = hash_block_tokens(None, [9, 9, 9, 9])
    tokens = [5, 6, 7, 8]
    hashes = {
        hash_block_tokens(None, tokens),
        hash_block_tokens(root, tokens),
        hash_block_tokens(other_root, tokens),
        hash_block_tokens(0, tokens),
        hash_block_tokens(root, tokens, ("lora", 1)),
        hash_block_tokens(root, tokens, ("lora", 2)),
        hash_block_tokens(root, [5, 6, 7, 9]),
    }
    assert len(hashes) == 7


def test_same_across_processes():
    code = (
        "from paphos.core.prefix_hash import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3]), [4, 5, 6], ('x', 1)))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1


def test_compute_block_hashes_is_incremental():
    req = make_request("r", list(range(10)))
    hashes = compute_block_hashes(req, 4)
    assert len(hashes) == 2 and hashes is req.block_hashes
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    first = list(hashes)
    req.append_output_token_ids([10, 11])
    compute_block_hashes(req, 4)
    assert req.block_hashes[:2] == first and len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])
