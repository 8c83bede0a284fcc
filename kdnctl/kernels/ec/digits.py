"""How ec packs small codes into bytes: the one definition the encoder (``kdnctl.quant.frames``)
and the compiled decoder (``kdnctl.kernels.ec.cpu``, which compiles this function) share."""

from __future__ import annotations


def codes_per_byte(peak: int) -> int:
    """How many codes in ``[-peak, peak]`` one byte holds as base-``2 peak + 1`` digits (1: none;
    0: every code is 0 and nothing is stored). Huffman coding spends at least one bit per
    symbol: grouping codes lets channels whose codes are nearly all 0 cost less than a bit."""
    if peak == 0:
        return 0
    radix, per = 2 * peak + 1, 1
    while radix ** (per + 1) <= 256:
        per += 1
    return per
