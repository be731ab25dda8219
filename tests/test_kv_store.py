"""The KV store's files (stage 14's helpers, which no exercise stubs): a file names its block and its model,
and is read once into memory, never mapped."""

import pytest
import torch

from minipaged.stage14_kv_connector import read_block, write_block

pytestmark = pytest.mark.common

BLOCK = 4


def test_a_block_read_is_a_copy_that_a_writer_changing_the_file_afterwards_cannot_reach(tmp_path):
    """The file is read into memory once, never mapped: rewritten in place or truncated after the read (as
    `cp` or a crash would), the K/V read stay what was read, and nothing faults."""
    kv = torch.arange(2 * 2 * BLOCK * 2 * 3, dtype=torch.float32).reshape(2, 2, BLOCK, 2, 3)
    path, digest = tmp_path / "b.safetensors", b"\x01" * 32
    write_block(path, kv, digest, "m")
    read = read_block(path, tuple(kv.shape), torch.float32, digest, "m")
    with path.open("r+b") as f:  # in place: the same inode
        f.write(b"\x00" * 64)
        f.truncate(100)
    assert torch.equal(read, kv)
    assert read_block(path, tuple(kv.shape), torch.float32, digest, "m") is None


def test_a_file_checked_is_a_file_of_this_block_of_this_model(tmp_path):
    kv, path = torch.ones(1, 2, BLOCK, 1, 2), tmp_path / "b.safetensors"
    write_block(path, kv, b"\x02" * 32, "m")
    assert read_block(path, tuple(kv.shape), torch.float32, b"\x02" * 32, "m") is not None
    assert read_block(path, tuple(kv.shape), torch.float32, b"\x03" * 32, "m") is None
    assert read_block(path, tuple(kv.shape), torch.float32, b"\x02" * 32, "n") is None
