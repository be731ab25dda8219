"""Random paged-attention inputs, with each sequence's K/V also kept contiguous (torch only)."""

import torch


def make_paged_inputs(heads, kv_heads, head_dim, block_size, seq_lens, query_lens=None,
                      dtype=torch.float32, seed=0, device="cpu", spare_blocks=5):
    """Scatter each sequence's K/V over randomly permuted physical blocks.

    Returns ``(args, contiguous)``: ``args`` for ``paged_attention_*`` (query, key_cache,
    value_cache, block_tables, seq_lens, query_start_loc) and, per sequence, its
    contiguous ``(keys, values)`` and its query rows.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    width = max(blocks_each) + 2  # wider than needed: entries past a sequence are never read
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    contiguous, used = [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_each, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        block_tables[i, :nb] = ids.to(torch.int32)
        contiguous.append((key_cache[ids].flatten(0, 1)[:n], value_cache[ids].flatten(0, 1)[:n]))
    if query_lens is None:
        query = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
        query_start_loc = None
        rows = [slice(i, i + 1) for i in range(len(seq_lens))]
    else:
        query = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        rows = [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
    cast = dict(dtype=dtype, device=device)
    args = (query.to(**cast), key_cache.to(**cast), value_cache.to(**cast), block_tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            None if query_start_loc is None else query_start_loc.to(device))
    return args, [(k.to(**cast), v.to(**cast), r) for (k, v), r in zip(contiguous, rows, strict=True)]
