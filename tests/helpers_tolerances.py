"""Every numerical tolerance of the tests, derived from the unit roundoff and the depth of the computation.

Two implementations of the same quantity (a paged kernel and dense attention, a chunked prefill and a
whole one, this engine and transformers) round differently: they sum in another order, with another
SIMD width or blocking, with or without FMA. Which of those a run gets depends on the CPU (ATen picks
its kernels at run time: AVX-512, AVX2 or none), so a tolerance read off one machine's results can
fail on another's. A tolerance here is a bound instead, which holds for every order:

* ``u``, the unit roundoff of the dtype, is half its machine epsilon: float32 2**-24, float16 2**-11,
  bfloat16 2**-8. An operation + - * / sqrt rounds within ``u`` of its exact result; exp, log and
  rsqrt, within one ulp: two roundings.
* A sum or a dot product of n terms, evaluated in any order, is within ``gamma(n) * sum(|terms|)`` of
  the exact value, ``gamma(n) = n u / (1 - n u)`` (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., section 3.1).
* Steps compose: ``(1 + gamma(a)) (1 + gamma(b)) <= 1 + gamma(a + b)`` (Higham, Lemma 3.3). A result
  that passes through reductions of n1, n2, ... terms has depth n1 + n2 + ...: it is within
  ``gamma(depth)`` of exact, relative to the magnitude of its terms.
* Two computations of one quantity, each within ``e`` of the exact value, are within ``2 e`` of each
  other (``apart``).

The magnitude is that of the terms, never of the result: terms that cancel leave their rounding
behind. Attention has a bound that follows from this alone (``attention_error``); a whole model has
none that is useful, and ``model_depth`` says what it assumes instead.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32, u: float | None = None) -> float:
    """Higham's gamma(n): the relative bound of an n-term sum or dot product computed in any order."""
    nu = n * (unit_roundoff(dtype) if u is None else u)
    if nu >= 1:
        raise ValueError(f"{n} roundings of {dtype} bound nothing: n u = {nu:.3g} >= 1")
    return nu / (1 - nu)


def apart(error: float) -> float:
    """Two computations, each within ``error`` of the exact value, are within twice it of each other."""
    return 2 * error


def accumulation_roundoff(tensor: torch.Tensor) -> float:
    """Float32 accumulation's roundoff. NVIDIA tensor cores may truncate instead of rounding their float32
    sums (Fasi, Higham, Mikaitis and Pranesh, 2021): a step there costs up to an ulp, not half of one."""
    return unit_roundoff() * (2 if tensor.is_cuda else 1)


# Attention: softmax(scale q.k) v over n keys, accumulated in float32 whatever the storage dtype.
#
# * A score is a head_dim-term dot product times the scale: within gamma(head_dim + 1) S of exact, where
#   S = scale max|q| max|k| bounds every score's terms (Cauchy-Schwarz: sum |q_i k_i| <= |q| |k|).
#   Softmax is shift invariant, but subtracting the running maximum rounds once more: by u |s - m|,
#   2 u S in all (an online softmax's maxima only grow, so their differences add up to at most 2 S).
#   The scores are off by delta = (gamma(head_dim + 1) + 2 u) S, plus whatever error q and k carry.
# * exp turns an absolute score error delta into a relative weight error expm1(delta), and rounds twice;
#   an online softmax rescales a key's weight at most once per later tile (a tile holds at least one
#   key: up to n times), with an exp and a product. Each weight is off by eta = expm1(delta) +
#   gamma(2 + 2 n), relative, and the same weight enters the weighted sum and the normalizer.
# * Weights p_j (1 + eta_j) move the output, a convex combination of the values, by
#   sum_j p_j eta_j (v_j - o) / (1 + sum_j p_j eta_j): at most eta / (1 - eta) 2 max|v|.
# * The weighted sum and the normalizer are n-term sums whose terms are each rescaled up to n times,
#   then divided: gamma(4 n + 2), relative to sum_j p_j |v_j| <= max|v|.
# * Values that carry an error of their own (a projection computed them) pass it on, at most whole.
# * Stored in half precision, a kernel may round the weights to the values' dtype before its product
#   with them (p.to(v.dtype), as flash kernels do), and rounds its output: 2 u_half max|v| more.


def attention_error(head_dim: int, context: int, score_terms: float, value_terms: float, *,
                    score_error: float = 0.0, value_error: float = 0.0,
                    storage: torch.dtype = torch.float32, u: float | None = None) -> float:
    """The most one computation of attention over ``context`` keys can be off the exact value.

    ``score_terms``: S, a bound on every score's sum |scale q_i k_i|; ``value_terms``: max|v|;
    ``score_error`` / ``value_error``: errors the scores / values already carry; ``storage``: the dtype
    the inputs and the output are stored in; ``u``: the roundoff of the float32 accumulation.
    """
    u = unit_roundoff() if u is None else u
    delta = score_error + (gamma(head_dim + 1, u=u) + 2 * u) * score_terms
    eta = math.expm1(delta) + gamma(2 + 2 * context, u=u)
    error = (2 * eta / (1 - eta) + gamma(4 * context + 2, u=u)) * value_terms + value_error
    if storage != torch.float32:
        error += 2 * unit_roundoff(storage) * (value_terms + value_error)
    return error


def _largest_norm(t: torch.Tensor) -> float:
    return t.detach().float().norm(dim=-1).max().item() if t.numel() else 0.0


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int,
              scale: float | None = None, *, reference_storage: torch.dtype = torch.float32) -> dict:
    """``assert_close``'s tolerances for two computations of the same attention output.

    ``query`` / ``keys`` / ``values``: tensors holding every query, key and value involved (a whole paged
    cache will do: more entries only make the magnitudes larger); ``context``: the longest context.
    The first computation stores in ``query.dtype``, the second in ``reference_storage``; both
    accumulate in float32 (on ``query.device``).
    """
    head_dim = query.shape[-1]
    if scale is None:  # attention's default scale
        scale = 1 / math.sqrt(head_dim)
    score_terms = scale * _largest_norm(query) * _largest_norm(keys)
    value_terms = values.detach().float().abs().max().item() if values.numel() else 0.0
    u = accumulation_roundoff(query)
    error = sum(attention_error(head_dim, context, score_terms, value_terms, storage=storage, u=u)
                for storage in (query.dtype, reference_storage))
    return {"rtol": 0.0, "atol": error}


# A whole model. Its layers can amplify an error by their condition number, and no worst-case bound
# of a whole network is of any use. The estimate here takes every block as well conditioned (a
# normalized residual block: the norm rescales its input, the residual adds), so that relative errors
# add along the network (Lemma 3.3) instead of multiplying: a result of depth n is taken to be within
# gamma(n) of exact relative to its own magnitude (the magnitude of the values compared: a logit's
# terms are of the order of the logits, and a log-probability is a difference of logits).
#
# Depth of one decoder layer, the lengths of the reductions a value passes through, in order:
#   norm          h/2 + 4    RMSNorm: a mean of h squares, positive terms, so within gamma(h) of itself,
#                            whose rsqrt halves that relative error; rsqrt, the two products
#                 3 h/2 + 4  LayerNorm (GPT-2): a mean of h terms before it, and the subtraction
#   qkv           h + 1      a projection: h products, the bias
#   positions     c + 4      the angle pos * inv_freq rounds by u pos, i.e. up to u c on an O(1) cos/sin;
#                            cos / sin and the rotation (learned position embeddings: one addition)
#   attention     d + 1 + 4 c + 4   a score; the weights' sum and the weighted sum, an online
#                            softmax rescaling each up to c times (as in attention_error)
#   o_proj        H d + 1    a projection over all heads
#   residual      1
#   norm          as above
#   up            h + 1
#   activation    8          silu or tanh-gelu: an exp or tanh and a few products
#   down          i + 1
#   residual      1
# then the final norm and the lm_head (h). h: hidden size, c: context, d: head dim,
# H: heads, i: intermediate size.


def norm_depth(config) -> int:
    h = config.hidden_size
    return (3 * h + 1) // 2 + 4 if config.model_type == "gpt2" else (h + 1) // 2 + 4


def layer_depth(config, context: int) -> int:
    h, d = config.hidden_size, config.head_dim
    norm = norm_depth(config)
    attention_block = norm + (h + 1) + (context + 4) + (d + 1 + 4 * context + 4) + (config.num_heads * d + 1) + 1
    mlp_block = norm + (h + 1) + 8 + (config.intermediate_size + 1) + 1
    return attention_block + mlp_block


def model_depth(config, context: int) -> int:
    """The depth of a logit: every layer, the final norm and the lm_head."""
    return config.num_layers * layer_depth(config, context) + norm_depth(config) + config.hidden_size


def kv_depth(config, context: int, layer: int) -> int:
    """The depth of layer ``layer``'s keys and values: the layers before it, its norm, qkv and positions."""
    return layer * layer_depth(config, context) + norm_depth(config) + (config.hidden_size + 1) + (context + 4)


def kv(config, context: int, layer: int, values: torch.Tensor) -> dict:
    """``assert_close``'s tolerances for two computations of layer ``layer``'s cached keys and values."""
    magnitude = values.detach().float().abs().max().item()
    return {"rtol": 0.0, "atol": apart(gamma(kv_depth(config, context, layer)) * magnitude)}


# Tensor parallelism splits the reductions of the row-parallel projections (o_proj, down_proj) over the
# ranks: each rank sums its share of the terms, an all-reduce sums the partial sums, then the bias is
# added. That is the same sum of the same terms in another order, which gamma(n) already bounds for any
# order; the embedding's all-reduce adds zeros to one row (exact), and gathering the logits moves them
# unchanged. A sharded model's logits and K/V are therefore within the depths above of a whole model's.


def logits(config, context: int, values: torch.Tensor) -> dict:
    """``assert_close``'s tolerances for two computations of the same logits (``values``: either of them)."""
    magnitude = values.detach().float().abs().max().item()
    return {"rtol": 0.0, "atol": apart(gamma(model_depth(config, context)) * magnitude)}


# A log-probability z_t - logsumexp(z): z_t is off by up to gamma(depth) |z|, and logsumexp, which moves
# by at most the largest change of a logit (it is 1-Lipschitz), by as much again: 2 gamma(depth),
# relative. Then logsumexp's own rounding: a sum of V positive terms, each an exp, and a log: relative
# error gamma(V + 2) on the sum, gamma(V + 4) absolute on its log, whatever the magnitude.


def approx(rel: float, abs: float) -> dict:
    """``pytest.approx``'s tolerances for an error of at most ``rel |expected| + abs``. approx allows the
    larger of the two, not their sum; ``(rel + abs) max(1, |expected|)`` is at least the sum."""
    return {"rel": rel + abs, "abs": rel + abs}


def logprobs(config, context: int) -> dict:
    """``pytest.approx``'s tolerances for two computations of the same log-probabilities."""
    return approx(apart(2 * gamma(model_depth(config, context))), apart(gamma(config.vocab_size + 4)))


def cumulative_logprob(config, context: int, steps: int) -> dict:
    """``pytest.approx``'s tolerances for two sums of ``steps`` log-probabilities: each off as above (all
    of one sign, so their magnitudes add up to the sum's), then the sum's own rounding, gamma(steps)."""
    return approx(*_cumulative(config, context, steps))


def _cumulative(config, context: int, steps: int) -> tuple[float, float]:
    return (apart(2 * gamma(model_depth(config, context)) + gamma(steps)),
            apart(steps * gamma(config.vocab_size + 4)))


def beam_score(config, context: int, steps: int, length_penalty: float) -> dict:
    """A beam's score, its cumulative log-probability over length**length_penalty (a power and a
    division: three roundings more); a negative penalty multiplies the sum, by up to steps**-penalty."""
    rel, abs_ = _cumulative(config, context, steps)
    return approx(rel + apart(gamma(3)), abs_ * max(1.0, steps**-length_penalty))


def paged_attention(args, scale: float | None = None, *, reference_storage: torch.dtype = torch.float32) -> dict:
    """``attention`` for ``paged_attention_*``'s arguments ``(query, key_cache, value_cache,
    block_tables, seq_lens, ...)``: every query, the whole caches, the longest sequence."""
    query, key_cache, value_cache, _, seq_lens = args[:5]
    return attention(query, key_cache, value_cache, int(seq_lens.max()), scale, reference_storage=reference_storage)
