"""Equivalence checks that say where two caches first differ, and the shadowed cache that the
block managers' state machines share."""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule


def assert_same_kv(got, want, *, seq, layer=0, what="K/V"):
    """``got`` and ``want`` (``(tokens, ...)``, or pairs of K and V) are equal, bit for bit.

    Otherwise the failure names the sequence, the layer and the first differing position.
    """
    if isinstance(got, tuple | list):
        for name, g, w in zip(("K", "V"), got, want, strict=True):
            assert_same_kv(g, w, seq=seq, layer=layer, what=name)
        return
    if got.shape != want.shape:
        raise AssertionError(f"sequence {seq!r}, layer {layer}: {what} read back has shape {tuple(got.shape)}, "
                             f"expected {tuple(want.shape)}")
    differs = (got != want).reshape(len(got), -1).any(dim=1).nonzero()
    if differs.numel():
        p = int(differs[0])
        raise AssertionError(f"sequence {seq!r}, layer {layer}: {what} first differs at position {p} "
                             f"(of {len(got)}): {got[p].flatten()[:4].tolist()} "
                             f"instead of {want[p].flatten()[:4].tolist()}")


class ShadowedKVMachine(RuleBasedStateMachine):
    """A block manager and its cache beside a shadow: every sequence's K/V as plain lists.

    Subclasses add the rules that write (allocate, append, fork); this one frees, checks that
    every sequence reads back its shadow, and, at the end, that no block leaked."""

    def __init__(self, manager, cache, num_blocks: int):
        super().__init__()
        self.manager, self.cache, self.num_blocks = manager, cache, num_blocks
        self.shadow: dict[int, list[float]] = {}
        self.counter = 0

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.shadow)))
        self.manager.free(seq_id)
        del self.shadow[seq_id]

    @invariant()
    def contents_equal_the_shadow(self):
        for seq_id, values in self.shadow.items():
            k, v = self.cache.gather(0, self.manager.get_block_table(seq_id), len(values))
            assert k.flatten().tolist() == values and v.flatten().tolist() == [-x for x in values]

    def teardown(self):
        for seq_id in list(self.shadow):
            self.manager.free(seq_id)
        assert self.manager.num_free_blocks == self.num_blocks  # nothing leaked
