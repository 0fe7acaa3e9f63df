"""Tolerances derived from what a comparison can guarantee on any CPU, not from what one CPU happened to print
(tests/README.md states the rule): the rounding of one computation checked against stored numbers or another code
path (``assert_close`` with ``FLOAT32_ULPS`` / ``BFLOAT16_STEP``), and how close two runs that train the same model
on the same global batches must be (the rest of this module).

Two such runs (one process vs DDP / FSDP2 / HSDP, accumulation vs a bigger batch, a resharded resume) differ only in
the order fp32 sums are taken: another split of the batch, another all-reduce, another SIMD kernel. What follows:

- **Before the first update** the weights and the samples are identical, so a logged loss or gradient norm is
  the same sum in another order. With pairwise/blocked summation its relative error is a few ulps times
  log2(terms); 1e-5 is ~100x what any kernel showed (<= 3e-7 with AVX-512, AVX2 or the scalar path).
- **After k updates** the runs have separated: Adam divides each gradient entry by its own magnitude, so an
  entry whose true gradient is at rounding level (e.g. the key bias of attention, exactly zero in exact
  arithmetic) takes a full +-lr step in a direction rounding chose. How that moves a logged quantity is
  chaotic, so the bound is set against the training signal itself: the deviation may grow by
  ``NOISE_FRACTION`` of the largest change the reference showed between two logs, per update after the first.
  Measured: the AVX2 and AVX-512 kernels of one run part by 1.9e-4 relative in the gradient norm after 6
  updates (0.0048 absolute), 75x inside this bound; a run on another global batch is off by whole units at its
  first log, far outside it.
- **Weights**: a flipped entry costs 2·lr per update at most, and two Adam trajectories can part by at most
  ``ADAM_MAX_STEP``·lr per update and entry. A real error (another batch, an unsynced gradient) moves nearly
  every weight by whole steps: measured 79% of entries beyond lr/10 after 6 updates, against 0 entries for
  matched runs on any kernel (largest difference 4.9e-6 = lr/20 with AVX2 vs AVX-512).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# --- one computation against stored numbers or another code path -------------------------------------------------
# MKL, oneDNN and ATen choose their kernels per CPU (vendor, AVX2 / AVX-512 / AMX), per thread count and per shape,
# and each kernel sums in its own order. Every result is still correctly rounded per operation, so two such runs
# part by a few units in the last place: relative to the value, and, for a sum that cancels, relative to its terms
# (an entry near zero keeps the absolute rounding of the large numbers it came from), which the largest entry of
# the expected tensor stands for. Measured: an Intel Xeon's MKL against an AMD EPYC's, 1 ulp on a Linear layer's
# output (65 of 1,920 entries of SmolVLA's state token).
FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23: one float32 ulp at 1.0
BFLOAT16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: one bfloat16 step at 1.0


def ulps(count: float, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """``count`` units in the last place of ``dtype``, for :func:`assert_close`: relative to each expected entry
    and to the largest one."""
    eps = torch.finfo(dtype).eps
    return {"rtol": count * eps, "magnitude_rtol": count * eps}


# A float32 result of a few operations (a layer, a padded copy through arithmetic, an update) recomputed with other
# kernels: the 1 ulp measured, and room for the handful of roundings a layer chains (8 ulps ~ 1e-6 relative).
FLOAT32_ULPS = ulps(8)
# A bfloat16 result: the accumulators are float32, but each output is rounded to bfloat16 once per operation, so a
# last-place difference of the accumulators flips an entry by one bfloat16 step (0.4-0.8 % of it) where it lands
# on a rounding boundary; the layers after it carry that step on. Two steps.
BFLOAT16_STEP = ulps(2, torch.bfloat16)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, magnitude_rtol: float = 0.0,
                 atol: float = 0.0, msg: str | None = None) -> None:
    """``torch.testing.assert_close`` (in float64, any dtype pair) with the allowed difference of each entry
    ``atol + rtol * |expected| + magnitude_rtol * max|expected|``. Shapes must match."""
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    expected64 = expected.double()
    scale = float(expected64.abs().max()) if expected64.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected64, rtol=rtol, atol=atol + magnitude_rtol * scale,
                               msg=(lambda default: f"{msg}: {default}") if msg else None)


# --- runs that train on the same global batches -------------------------------------------------------------------
FIRST_UPDATE_RTOL = 1e-5
NOISE_FRACTION = 1e-3
# |Adam step| <= lr * (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr with the default betas (0.9, 0.999).
ADAM_MAX_STEP = 3.2
# Entries of one tensor that may sit beyond lr/10 (rounding-level gradients that flipped): 1%, at least 2.
FLIPPED_FRACTION, FLIPPED_MIN = 0.01, 2


def allowed_deviation(expected: Sequence[float], index: int, updates_before: int) -> float:
    """The absolute deviation allowed for ``expected[index]``, logged after ``updates_before`` optimizer updates."""
    steps = [abs(b - a) for a, b in zip(expected, expected[1:])]
    growth = NOISE_FRACTION * updates_before * max(steps, default=0.0)
    return FIRST_UPDATE_RTOL * abs(expected[index]) + growth


def assert_same_series(actual: Sequence[float], expected: Sequence[float], updates_before: Sequence[int],
                       what: str) -> None:
    """``actual`` and ``expected`` logged at the same points, the k-th after ``updates_before[k]`` updates."""
    assert len(actual) == len(expected) == len(updates_before), (what, actual, expected)
    for index, (got, want, num_updates) in enumerate(zip(actual, expected, updates_before)):
        bound = allowed_deviation(expected, index, num_updates)
        assert abs(got - want) <= bound, (
            f"{what}[{index}] after {num_updates} updates: {got!r} vs {want!r}, "
            f"deviation {abs(got - want):.3g} > allowed {bound:.3g}"
        )


def weight_mismatches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], num_updates: int,
                      lr: float, flipped_fraction: float = FLIPPED_FRACTION) -> list[str]:
    """What keeps two state dicts from being the same training after ``num_updates`` Adam updates at ``lr``."""
    problems = [] if actual.keys() == expected.keys() else [f"keys differ: {sorted(actual.keys() ^ expected.keys())}"]
    for name in sorted(actual.keys() & expected.keys()):
        diff = (actual[name].double() - expected[name].double()).abs().flatten()
        if name.endswith("in_proj_bias"):  # [query; key; value]: the key third has a zero gradient, only noise
            third = diff.numel() // 3
            noise_only, diff = diff[third : 2 * third], torch.cat([diff[:third], diff[2 * third :]])
            if noise_only.numel() and noise_only.max() > 2 * num_updates * lr:
                problems.append(f"{name} (key third): {noise_only.max():.3g} > 2 x {num_updates} x lr")
        if not diff.numel():
            continue
        flipped = int((diff > lr / 10).sum())
        if flipped > max(FLIPPED_MIN, flipped_fraction * diff.numel()):
            problems.append(f"{name}: {flipped}/{diff.numel()} entries differ by more than lr/10")
        if diff.max() > ADAM_MAX_STEP * 2 * num_updates * lr:
            problems.append(f"{name}: {diff.max():.3g} is more than two Adam trajectories can part")
    return problems


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], num_updates: int,
                        lr: float, flipped_fraction: float = FLIPPED_FRACTION) -> None:
    problems = weight_mismatches(actual, expected, num_updates, lr, flipped_fraction)
    assert not problems, "\n".join(problems)
