from __future__ import annotations

import math

import torch

from stage4_fast.core import Batch, Req, SamplingParams
from stage4_fast.engine import Sampler
from stage4_fast.engine.sample import BatchSamplingArgs, filter_probs

VOCAB = 100


def _sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.device("cpu"), VOCAB, seed=seed)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _batch(params: list[SamplingParams]) -> Batch:
    reqs = [Req(torch.tensor([1], dtype=torch.int32), i, 0, 4, i, p) for i, p in enumerate(params)]
    return Batch(reqs, "decode")


def test_temperature_zero_is_greedy_even_beside_sampled_requests():
    logits = _logits(6)
    params = [SamplingParams(temperature=t) for t in (0.0, 1.5, 0.0, 0.7, 0.0, 2.0)]
    sampler = _sampler()
    args = sampler.prepare(_batch(params))
    tokens = sampler.sample(logits, args)
    greedy_rows = [0, 2, 4]
    assert torch.equal(tokens[greedy_rows], logits.argmax(-1)[greedy_rows])
    # an all-greedy batch skips the softmax entirely
    assert sampler.prepare(_batch([SamplingParams()] * 3)).temperatures is None
    assert torch.equal(sampler.sample(logits[:3], BatchSamplingArgs(None)), logits[:3].argmax(-1))


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # 1e-40 is a positive float32 (subnormal): logits / 1e-40 overflow to inf, the probabilities become NaN and
    # torch.multinomial raises, which would take the whole batch (a server's scheduler) down
    logits = _logits(4, seed=4)
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-40, top_p=0.9),
              SamplingParams(temperature=1e-6, top_k=5), SamplingParams(temperature=1.0)]
    sampler = _sampler()
    tokens = sampler.sample(logits, sampler.prepare(_batch(params)))
    assert torch.equal(tokens[:3], logits.argmax(-1)[:3])


def test_top_k_one_is_greedy():
    logits = _logits(64, seed=1)
    sampler = _sampler()
    args = sampler.prepare(_batch([SamplingParams(temperature=5.0, top_k=1, top_p=0.99)] * 64))
    for _ in range(5):
        assert torch.equal(sampler.sample(logits, args), logits.argmax(-1))


def test_top_p_keeps_exactly_the_nucleus():
    # sorted probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 placed at shuffled token ids
    probs_sorted = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    probs = torch.zeros(1, 6).scatter_(1, perm[None], probs_sorted[None])
    # the nucleus for p is the shortest prefix of the sorted list whose mass reaches p
    # (cumulative: 0.4, 0.65, 0.8, 0.9, 0.96, 1.0; no p sits on a boundary, where float rounding would decide)
    cases = {0.3: 1, 0.5: 2, 0.7: 3, 0.85: 4, 0.93: 5, 0.99: 6, 1.0: 6}
    for top_p, size in cases.items():
        filtered = filter_probs(probs, None, torch.tensor([top_p]))
        kept = set(filtered[0].nonzero().flatten().tolist())
        assert kept == set(perm[:size].tolist()), top_p
        expected = probs_sorted[:size] / probs_sorted[:size].sum()
        torch.testing.assert_close(filtered[0, perm[:size]], expected)


def test_top_p_sampling_only_returns_nucleus_tokens():
    logits = _logits(1, seed=2)
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True)
    nucleus_size = int((probs[order].cumsum(0) < 0.6).sum()) + 1
    nucleus = set(order[:nucleus_size].tolist())
    sampler = _sampler()
    args = sampler.prepare(_batch([SamplingParams(temperature=1.0, top_p=0.6)] * 2000))
    drawn = set(sampler.sample(logits.expand(2000, -1), args).tolist())
    assert drawn == nucleus  # every nucleus token shows up in 2000 draws (each has p >= 0.6 / nucleus_size)


def _assert_frequencies_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Each token's count over N independent draws is Binomial(N, p): mean N p, std sqrt(N p (1 - p)). We allow 5
    standard deviations of the frequency, sqrt(p (1 - p) / N); by the normal approximation a correct sampler falls
    outside that with probability < 6e-7 per token, so the bound is not tuned to the seed, while a wrong temperature
    or a dropped token moves frequencies by far more than it."""
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / n
    for token, p in enumerate(expected.double().tolist()):
        tolerance = 5 * math.sqrt(p * (1 - p) / n)
        assert abs(freq[token].item() - p) <= tolerance, (token, freq[token].item(), p, tolerance)


def test_seeded_sampling_frequencies_follow_the_tempered_distribution():
    n = 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sampler = Sampler(torch.device("cpu"), 5, seed=1234)
    for temperature in (1.0, 0.5, 2.0):
        args = BatchSamplingArgs(torch.full((n,), temperature))
        tokens = sampler.sample(logits.expand(n, -1), args)  # one batched call: n requests, same logits
        _assert_frequencies_match(tokens, (logits / temperature).softmax(-1))


def test_top_k_frequencies_are_the_renormalised_top_k():
    n = 40000
    logits = torch.tensor([0.1, 2.0, -0.5, 1.0, 1.5, 0.0])
    sampler = Sampler(torch.device("cpu"), 6, seed=99)
    args = BatchSamplingArgs(torch.ones(n), top_k=torch.full((n,), 3))
    tokens = sampler.sample(logits.expand(n, -1), args)
    expected = torch.zeros(6)
    expected[[1, 4, 3]] = logits[[1, 4, 3]].softmax(-1)
    _assert_frequencies_match(tokens, expected)


def test_same_seed_same_samples():
    logits = _logits(32, seed=3)
    args = BatchSamplingArgs(torch.ones(32))
    assert torch.equal(_sampler(7).sample(logits, args), _sampler(7).sample(logits, args))


def test_prepare_builds_per_request_tensors():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.9),
    ]
    args = _sampler().prepare(_batch(params))
    assert args.temperatures.tolist() == [0.0, 0.800000011920929, 1.2000000476837158]
    assert args.top_k.tolist() == [VOCAB, 5, VOCAB]  # no limit = the whole vocabulary
    assert args.top_p.tolist() == [1.0, 1.0, 0.8999999761581421]


def test_per_request_seeds_draw_from_the_distribution():
    """n requests with n different seeds, one batched draw: the frequencies are those of the distribution (the
    seeded uniforms are uniform), top-p applied."""
    n = 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    args = BatchSamplingArgs(torch.ones(n), top_p=torch.full((n,), 0.9), seeds=list(range(10**6, 10**6 + n)))
    tokens = Sampler(torch.device("cpu"), 5, seed=0).sample(logits.expand(n, -1), args)
    expected = filter_probs(logits.softmax(-1)[None], None, torch.tensor([0.9]))[0]
    _assert_frequencies_match(tokens, expected)


def test_a_seeded_draw_depends_on_its_seed_not_on_its_batch():
    logits = _logits(8, seed=5)
    alone = _sampler(1).sample(logits[3:4], BatchSamplingArgs(torch.ones(1), seeds=[12345]))
    seeds = [None, 7, None, 12345, None, None, 9, None]
    for generator_seed in (2, 3):  # the unseeded rows draw differently, the seeded one does not
        tokens = _sampler(generator_seed).sample(logits, BatchSamplingArgs(torch.ones(8), seeds=seeds))
        assert tokens[3] == alone[0]


def test_inverse_cdf_draw_never_returns_a_zero_probability_token():
    from stage4_fast.engine.sample import draw_by_inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)  # unnormalised rows work too: the total scales the draw
    uniforms = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-53], dtype=torch.float64)
    assert draw_by_inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3, 3]
    assert draw_by_inverse_cdf(probs * 7, uniforms).tolist() == [1, 1, 3, 3, 3]


def test_a_plain_batch_skips_the_api_fields_and_each_field_still_counts():
    """prepare() skips the API fields' passes for a batch where no request asks for one; each field alone, beside
    plain requests, must still get its tensors (a field the shortcut did not know would be silently dropped)."""
    sampler = _sampler()
    plain = sampler.prepare(_batch([SamplingParams(), SamplingParams(temperature=0.7)]), torch.zeros(4, 8))
    assert (plain.logit_bias, plain.penalties, plain.logprobs, plain.grammar_uids, plain.token_pool) == (None,) * 5
    asks = {
        "logit_bias": SamplingParams(logit_bias=((3, 2.0),)),
        "penalties": SamplingParams(presence_penalty=0.5),
        "logprobs": SamplingParams(logprobs=2),
    }
    for field, params in asks.items():
        args = sampler.prepare(_batch([SamplingParams(), params]), torch.zeros(4, 8, dtype=torch.int32))
        assert getattr(args, field) is not None, field
