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


def before_the_window_as_nan(args, sliding_window, query_lens=None):
    """``args`` whose tables name, for each sequence, a block of NaN in place of every whole block
    before its first query's window: blocks a windowed attention must never read."""
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = args
    nan = torch.full_like(key_cache[:1], float("nan"))
    key_cache, value_cache = torch.cat([key_cache, nan]), torch.cat([value_cache, nan])
    block_tables, block_size = block_tables.clone(), key_cache.shape[1]
    for row, length in enumerate(seq_lens.tolist()):
        window_start = max(0, length - (1 if query_lens is None else query_lens[row]) - sliding_window + 1)
        block_tables[row, : window_start // block_size] = key_cache.shape[0] - 1
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc


def windowed_dense(query, contiguous, sliding_window):
    """Stage 0's attention with a window, sequence by sequence: what every paged path must equal."""
    from minipaged.stage0_contiguous import dense_attention

    return torch.cat([dense_attention(query[rows], keys, values, causal=True, sliding_window=sliding_window)
                      for keys, values, rows in contiguous])
