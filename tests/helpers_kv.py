"""Equivalence checks that say where two caches first differ."""



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
                             f"(of {len(got)}): {got[p].flatten()[:4].tolist()} instead of {want[p].flatten()[:4].tolist()}")
