"""What the compiled decoder reports per blob: 0 (decoded) or one of these codes, and the
message the loader raises for it."""

# error codes of decode_blobs, per blob (0: decoded)
ERR_WIDTH, ERR_FRAMES, ERR_SIZES, ERR_INFLATE, ERR_RANGE, ERR_ZERO = 1, 2, 3, 4, 5, 6
MESSAGES = {
    ERR_WIDTH: "codes has an unknown code width",
    ERR_FRAMES: "codes holds a number of frames its bins do not need",
    ERR_SIZES: "codes: its frame sizes do not add up",
    ERR_INFLATE: "codes: a frame is not a valid deflate stream of exactly the bytes it needs",
    ERR_RANGE: "packed codes out of range",
    ERR_ZERO: "codes: an all-zero frame holds bytes",
}
