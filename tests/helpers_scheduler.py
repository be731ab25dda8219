"""A fake model that reads the KV cache, and a loop that serves requests through a scheduler.

The fake model writes, for each new token, K = V = token * 1000 + position, checks that the
cache gathers exactly those values back for the whole sequence, and picks the next token
from them. A lost, stale or misplaced block changes the outputs, or fails the check.
"""

import torch

VOCAB = 50


class CacheReadingModel:
    def __init__(self, scheduler, cache):
        self.scheduler, self.cache = scheduler, cache
        self.first_admissions = []  # seq ids, in the order they were first prefilled

    def step(self, out):
        manager = self.scheduler.block_manager
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        tokens = {}
        for seq, n in out.scheduled:
            if n == len(seq) and seq.seq_id not in self.first_admissions:  # a first prefill
                self.first_admissions.append(seq.seq_id)
            total = len(seq)
            expected = torch.tensor([t * 1000.0 + p for p, t in enumerate(seq.token_ids)], dtype=torch.float64)
            new = expected[total - n :].view(n, 1, 1)
            self.cache.write(0, manager.slot_mapping([seq.seq_id], [n]), new, -new)
            k, v = self.cache.gather(0, manager.get_block_table(seq.seq_id), total)
            assert torch.equal(k.flatten(), expected) and torch.equal(v.flatten(), -expected), "cache corrupted"
            tokens[seq] = int(k.sum().item() * 7 + total) % VOCAB
        return tokens


def serve(scheduler, cache, requests, max_steps=100_000, check=None):
    """Serve ``requests`` ``[(prompt, max_tokens, arrival_step)]``; return outputs in request order."""
    model = CacheReadingModel(scheduler, cache)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    seqs = {}
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            seqs[i] = scheduler.add_sequence(requests[i][0], requests[i][1])
        out = scheduler.schedule()
        if check:
            check(scheduler, out)
        for seq, token in model.step(out).items():
            scheduler.append_token(seq, token)
            if len(seq.output_token_ids) == seq.max_tokens:
                scheduler.finish(seq)
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    return [seqs[i].output_token_ids for i in range(len(requests))], model
