"""The rounding-error model behind every numeric tolerance in this suite.

A tolerance tuned on one machine fails on the next: BLAS libraries pick their
kernels per CPU, per instruction set and per row count, so the rounding a test
sees depends on where it runs (issue 11: 1.1e-5 on an AMD EPYC against a 1e-5
bound found on an Intel Xeon). Every bound here follows instead from four rules:

1. Each elementary operation rounds with relative error at most u, the unit
   roundoff of its dtype (2^-24 for float32, 2^-11 float16, 2^-8 bfloat16).
2. A reduction of K terms (a dot product, a sum, a softmax denominator), in any
   order, blocking or SIMD width, with or without FMA, is off by at most
   sqrt(K) * u * sum(|terms|): the probabilistic bound of Higham & Mary (SIAM J.
   Sci. Comput. 41(5), 2019) at lambda = 1. The deterministic K * u holds for
   adversarial inputs only; no BLAS comes near it on real activations.
3. A forward pass sums the errors of every reduction on its path, linearly.
   Independent errors add in quadrature, so the linear sum is sqrt(#reductions)
   (about 16 for a 30-layer model) above the typical case: that covers lambda > 1
   and the moderate amplification of a pre-norm residual network. Where the two
   sides build RoPE tables by different routes (transformers computes the angle
   p * theta in float32, we in float64), q and k also turn by up to p * u.
4. Two evaluations by different kernels (batched vs solo rows, MKL vs oneDNN,
   ours vs transformers, another CPU) each lie within the bound of the exact
   result, so they differ by at most twice it.

Errors are normwise relative, max|got - expected| / max|expected|, so a bound
does not depend on a model's logit scale.

A real bug is orders of magnitude above these bounds: a row at the wrong
position or in the wrong session changes logits by O(1) of their scale
(tests/test_model_runtime.py pins that), while the bound for the whole
SmolLM2 forward is ~6e-4. `record` keeps every comparison's observed error and
bound; conftest prints them tightest first at the end of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from skippy.model.args import ModelArgs


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def reduction_error(length: int, dtype: torch.dtype = torch.float32) -> float:
    """Rule 2: relative error of a sum of `length` terms, in any order."""
    return math.sqrt(length) * unit_roundoff(dtype)


def layer_error(args: ModelArgs, positions: int, dtype: torch.dtype = torch.float32, rope_angles: bool = False) -> float:
    """Rule 3 for one block, attending over `positions` keys; `rope_angles` when
    the sides compute RoPE angles differently."""
    d, t = args.hidden_size, max(positions, 1)
    reductions = [
        d,  # attention RMSNorm's sum of squares
        d,  # q, k, v projections
        args.head_dim,  # q . k scores
        t,  # softmax denominator
        t,  # probabilities . values
        args.num_heads * args.head_dim,  # output projection
        d,  # feed-forward RMSNorm
        d,  # gate and up projections
        args.intermediate_size,  # down projection
    ]
    rope = 2 * t * unit_roundoff(dtype) if rope_angles else 0.0  # q and k, each off by p * u
    return sum(reduction_error(k, dtype) for k in reductions) + rope


def forward_tolerance(
    args: ModelArgs,
    *,
    layers: int,
    positions: int,
    head: bool,
    evaluations: int = 2,
    rope_angles: bool = False,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Bound on the normwise relative difference between `evaluations` (rule 4)
    computations of `layers` blocks over `positions` keys, plus the final norm and
    output head when `head`."""
    error = layers * layer_error(args, positions, dtype, rope_angles)
    if head:
        error += 2 * reduction_error(args.hidden_size, dtype)  # output RMSNorm, then the head
    return evaluations * error


def sampling_slack(num_vocab: int, max_abs_logit: float, dtype: torch.dtype = torch.float32) -> float:
    """How far float32 top-p / min-p filtering may sit from a float64 oracle, as
    probability mass (top-p) or logit (min-p): the log-sum-exp over the vocabulary
    (rule 2), each exp(x - logsumexp) whose argument rounds at the logits' scale,
    and the cumulative sum of the kept probabilities (at most the vocabulary)."""
    u = unit_roundoff(dtype)
    log_sum_exp = reduction_error(num_vocab, dtype) + 2 * max_abs_logit * u
    exponent = 2 * (max_abs_logit + math.log(num_vocab)) * u
    return log_sum_exp + exponent + reduction_error(num_vocab, dtype)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.double().cpu(), expected.double().cpu()
    return ((got - expected).abs().max() / expected.abs().max()).item()


@dataclass(frozen=True)
class Margin:
    what: str
    observed: float
    limit: float
    worst_case: bool = False  # a provable bound the error may reach, not a statistical one

    @property
    def ratio(self) -> float:
        """limit / observed: how many times the observed error fits under its bound."""
        return math.inf if self.observed == 0 else self.limit / self.observed


MARGINS: list[Margin] = []


def record(what: str, observed: float, limit: float, *, worst_case: bool = False) -> None:
    """Keep one comparison for the end-of-run report, then assert it."""
    MARGINS.append(Margin(what, observed, limit, worst_case))
    assert observed <= limit, f"{what}: observed {observed:.3g} > bound {limit:.3g}"


def assert_close(what: str, got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    """Normwise relative error within `tolerance` (from forward_tolerance or the like)."""
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    record(what, relative_error(got, expected), tolerance)
