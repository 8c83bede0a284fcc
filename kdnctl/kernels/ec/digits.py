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


OWN_WIDTHS = 3  # a codes blob's width byte (format 1.11): each frame of one code per byte its own width


def frame_width(width: int, peak: int) -> int:
    """Bytes per code of a frame that stores one code per byte-group, in a codes blob of
    ``width`` (1: int8, 2: int16, ``OWN_WIDTHS``: int8 where the frame's peak fits, else int16).
    Width 2 gives every frame of a role two bytes where any of its codes needs them; the second
    byte of a small code costs at least a bit of Huffman code for nothing (~12% of the 0.25
    default's bytes), so the encoder writes ``OWN_WIDTHS``."""
    if width == OWN_WIDTHS:
        return 1 if peak <= 127 else 2
    return width
