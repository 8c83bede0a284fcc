"""Rate allocation of the entropy-coded ``ec`` layout: per-channel steps under a byte cap.

For a squared error weighted by ``w_c`` (``kdnctl.quant.sensitivity``) and an entropy-coded
uniform quantizer, the high-rate optimum gives every channel the same weighted error, i.e. a
step proportional to ``1 / sqrt(w_c)``; channels whose spread is below their step get (almost)
no bits, which is reverse water-filling. Across heads and layers the steps are normalised so
every head has the same error relative to its own weighted energy (as a fixed-rate quantizer
has), and one global scale ``alpha`` sets the rate: :func:`fit_scale` finds the finest scale
whose encoded bytes fit the cap (bytes fall as the scale grows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..kernels.channel_stats import channel_var

STEP_MIN, STEP_MAX = 1e-4, 6e4  # float16-representable steps
CODE_MAX = 30000  # int16 codes, with room


def relative_steps(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Base steps ``[H, D]`` of one role of one layer (``x [H, T, D]`` transformed, ``w [H, D]``):
    ``step_c = s_h / sqrt(w_c)`` with ``s_h^2 = mean_c(w_c * var_c)``, so at scale ``alpha`` every
    head's weighted squared error is ``alpha^2 / 12`` of its weighted variance."""
    var = channel_var(x) if x.shape[1] else torch.zeros_like(w)
    w = w.clamp_min(0)
    s = (w * var).mean(-1, keepdim=True).sqrt()
    base = s / w.clamp_min(1e-12).sqrt()
    return base.nan_to_num(STEP_MAX, STEP_MAX, STEP_MAX)


def step_floor(x: torch.Tensor, finest_level: int) -> torch.Tensor:
    """The finest steps ``[H, D]`` that keep float16 steps and every code of ``x [H, T, D]``
    within int16 at the finest token level, whatever mean of any span of tokens (a 256-token
    chunk's) is subtracted: ``|x - mean| <= max - min``."""
    spread = x.amax(1) - x.amin(1) if x.shape[1] else torch.zeros(x.shape[0], x.shape[2])
    return (spread * 2 ** finest_level / CODE_MAX).clamp_min(STEP_MIN)


def clamp_steps(step: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    return torch.maximum(step, floor).clamp_max(STEP_MAX)


def fit_scale(size_at: Callable[[float], int], cap: float, lo: float = 1 / 64, hi: float = 64.0,
              tol: float = 5e-4, guess: float | None = None) -> float | None:
    """The smallest ``alpha`` in ``[lo, hi]`` with ``size_at(alpha) <= cap``, to within a factor
    ``exp(tol)``; None if even ``hi`` does not fit. ``size_at`` falls as ``alpha`` grows, nearly
    as a power law, so the bracket shrinks by false position on (log alpha, log size) with the
    Illinois correction (an end kept twice has its value halved), and once a guess lands within
    ``2 tol`` of the cap the other side ``tol/2`` away is tested too: about ten encodings
    instead of a bisection's twenty (``tests/test_ec.py`` checks the result against brute force).

    With ``guess`` (a scale near the answer) the bracket is first found next to it by secant
    steps (:func:`_bracket_near`), usually already as narrow as ``tol``, and the search finishes
    inside it: the same answer to the same tolerance in about a third of the encodings; where
    the steps find no bracket it searches ``[lo, hi]``. Each scale is sized once."""
    seen: dict[float, int] = {}

    def sized(a: float) -> int:
        if a not in seen:
            seen[a] = size_at(a)
        return seen[a]

    if guess is not None and cap > 0:  # (no scale fits a cap of no bytes: the search says so)
        near = _bracket_near(sized, cap, guess, lo, hi, tol)
        if near is not None:
            return _false_position(sized, cap, *near, tol)
    return _false_position(sized, cap, lo, hi, tol)


def _bracket_near(size_at: Callable[[float], int], cap: float, guess: float, lo: float, hi: float, tol: float,
                  max_probes: int = 8) -> tuple[float, float] | None:
    """``(a, b)`` inside ``[lo, hi]`` with ``size_at(a) > cap >= size_at(b)``, as narrow as the
    steps get it (``b / a`` at most ``exp(tol)`` when they converge): secant steps on (log alpha,
    log size) from ``guess`` predict where the size meets the cap, and each aims ``tol / 4``
    past that point on the side the last size was not, so two steps in a row straddle it.
    The first step takes a slope of -0.5 (the defaults' sizes fall about as ``alpha ** -0.5``
    near their cap). None where no size above the cap and none under it were found."""
    xlo, xhi = math.log(lo), math.log(hi)
    pts: dict[float, float] = {}

    def f(x: float) -> float:
        if x not in pts:
            pts[x] = math.log(max(size_at(math.exp(x)), 1)) - math.log(cap)
        return pts[x]

    x, prev = min(max(math.log(guess), xlo), xhi), None
    a = b = None
    for _ in range(max_probes):
        v = f(x)
        big = [p for p, w in pts.items() if w > 0]
        fits = [p for p, w in pts.items() if w <= 0]
        a, b = (max(big) if big else None), (min(fits) if fits else None)
        if a is not None and b is not None and a < b <= a + tol:
            break
        slope = (v - prev[1]) / (x - prev[0]) if prev is not None and x != prev[0] and v != prev[1] else -0.5
        if slope >= 0:
            slope = -0.5
        root = x - v / slope
        nx = root - tol / 4 if v <= 0 else root + tol / 4  # just across the predicted meeting point
        nx = min(max(nx, x - 1.5), x + 1.5, xhi)
        nx = max(nx, xlo)
        if a is not None and b is not None and not a < nx < b:
            nx = (a + b) / 2
        if nx == x:
            break
        prev, x = (x, v), nx
    if a is None or b is None or not a < b:
        return None
    return math.exp(a), math.exp(b)


def _false_position(size_at: Callable[[float], int], cap: float, lo: float, hi: float, tol: float) -> float | None:
    """:func:`fit_scale`'s search of ``[lo, hi]``."""
    if size_at(hi) > cap:
        return None
    f_lo = math.log(max(size_at(lo), 1)) - math.log(cap)
    if f_lo <= 0:
        return lo
    a, b = math.log(lo), math.log(hi)  # a: too big, b: fits
    fa, fb = f_lo, math.log(max(size_at(hi), 1)) - math.log(cap)
    side = 0

    def probe(m: float) -> float:
        nonlocal a, b, fa, fb
        f = math.log(max(size_at(math.exp(m)), 1)) - math.log(cap)
        if f <= 0:
            b, fb = m, f
        else:
            a, fa = m, f
        return f

    while b - a > tol:
        m = (a * fb - b * fa) / (fb - fa) if fb != fa else (a + b) / 2
        if not a + tol / 4 < m < b - tol / 4:
            m = (a + b) / 2
        keep_a, keep_b = fa, fb
        f = probe(m)
        if f <= 0:
            fa = keep_a / 2 if side == 1 else fa
            side = 1
        else:
            fb = keep_b / 2 if side == -1 else fb
            side = -1
        other = m - tol / 2 if f <= 0 else m + tol / 2
        if abs(f) < 2 * tol and b - a > tol and a < other < b:
            probe(other)
    return math.exp(b)


RTOL = 0.002  # fit_near stops at a size within this share under the cap


def fit_near(size_at: Callable[[float], int], cap: float, guess: float = 0.5, rtol: float = RTOL,
             lo: float = 1 / 64, hi: float = 64.0, max_probes: int = 8) -> float | None:
    """A scale ``alpha`` in ``[lo, hi]`` with ``(1 - rtol) cap <= size_at(alpha) <= cap`` (or the
    smallest that fits within ``fit_scale``'s tolerance), None if even ``hi`` does not fit.

    Encoded bytes fall with ``alpha`` nearly as a power law, so secant steps on (log alpha,
    log size) from ``guess`` (the last fit, or the defaults' usual scale) land inside the window
    in three or four encodings; each step stays inside the bracket found so far. Where that
    does not converge, :func:`fit_scale` finishes inside the bracket."""
    target = math.log1p(-rtol / 2)
    seen: dict[float, float] = {}

    def f(a: float) -> float:
        if a not in seen:
            seen[a] = math.log(max(size_at(a), 1)) - math.log(cap)
        return seen[a]

    def inside(v: float) -> bool:
        return math.log1p(-rtol) <= v <= 0

    x0 = math.log(min(max(guess, lo), hi))
    f0 = f(math.exp(x0))
    if inside(f0):
        return math.exp(x0)
    x1 = min(max(x0 + (0.05 if f0 > 0 else -0.05), math.log(lo)), math.log(hi))
    for _ in range(max_probes - 1):
        f1 = f(math.exp(x1))
        if inside(f1):
            return math.exp(x1)
        fits = [math.log(a) for a, v in seen.items() if v <= 0]
        big = [math.log(a) for a, v in seen.items() if v > 0]
        a_hi = min(fits) if fits else None  # the finest scale that fits
        a_lo = max(big) if big else None  # the coarsest that does not
        if f1 > 0 and x1 >= math.log(hi):
            return None  # even the coarsest steps do not fit
        if f1 <= 0 and x1 <= math.log(lo):
            return lo
        slope = (f1 - f0) / (x1 - x0) if x1 != x0 and f1 != f0 else -1.0
        x = x1 + (target - f1) / slope if slope < 0 else x1 + (0.5 if f1 > 0 else -0.5)
        x = min(max(x, x1 - 1.5), x1 + 1.5, math.log(hi))
        x = max(x, math.log(lo))
        if a_hi is not None and a_lo is not None and not a_lo < x < a_hi:
            x = (a_lo + a_hi) / 2
        x0, f0, x1 = x1, f1, x
    fits = [a for a, v in seen.items() if v <= 0]
    big = [a for a, v in seen.items() if v > 0]
    if fits and big:
        return fit_scale(size_at, cap, max(big), min(fits))
    return fit_scale(size_at, cap, lo, hi)
