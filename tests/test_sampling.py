"""The two-level inverse CDF of the compiled decode step's sampling: the token the full-width
running sum would pick (computed here in float64), never a token of zero weight, the nucleus kept,
and compiled, no buffer as wide as the vocabulary."""

from __future__ import annotations

import pytest
import torch

from resilient_rl.models.sampling import pick_from_weights, pick_tokens


def full_width_reference(logits: torch.Tensor, temperature: float, draw: torch.Tensor):
    """The token by a float64 running sum over the whole row, and the draw's distance (relative to
    the row's mass) to the nearest boundary of the running sum, where fp32 rounding may go either way."""
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
    target = draw.double() * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    upper = cdf.gather(1, token[:, None])
    lower = torch.where(token[:, None] > 0, cdf.gather(1, (token[:, None] - 1).clamp(min=0)), torch.zeros_like(upper))
    return token, torch.minimum(upper - target, target - lower).squeeze(1)


@pytest.mark.parametrize("vocab,block", [(50_000, 1024), (1000, 64), (37, 8), (5, 1024)])
def test_the_two_levels_pick_the_full_width_token(vocab, block):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=gen) * 3
    draw = torch.rand(256, 1, generator=gen)
    ref, margin = full_width_reference(logits, 0.7, draw)
    weights = torch.exp((logits - logits.amax(dim=-1, keepdim=True)) / 0.7)
    for got in (pick_from_weights(weights, draw, block), pick_tokens(logits, 0.7, 1.0, draw)):
        clear = margin > 1e-6  # rows whose draw is not on a boundary within fp32 rounding
        assert clear.sum() > 240
        assert torch.equal(got[clear], ref[clear])


def test_an_entry_of_zero_weight_is_never_picked():
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0]]).expand(5, 7).contiguous()
    # Draws at 0, inside, at the top of the range and (rounding) at the very end of the row.
    draw = torch.tensor([[0.0], [0.4], [0.99999994], [1.0], [1.0 + 1e-6]])
    for block in (1, 2, 3, 4, 1024):  # blocks of zero mass, a padded last block, one block
        picked = pick_from_weights(weights, draw, block)
        assert picked.tolist() == [1, 3, 3, 3, 3], block


def test_the_nucleus_keeps_only_its_tokens_and_greedy_takes_the_argmax():
    logits = torch.tensor([0.1, 0.4, 0.3, 0.2]).log().expand(2000, 4)
    draw = torch.rand(2000, 1, generator=torch.Generator().manual_seed(0))
    assert set(pick_tokens(logits, 1.0, 0.5, draw).tolist()) == {1, 2}
    picked = pick_tokens(logits, 1.0, 1.0, draw)
    freq = picked.bincount(minlength=4).float() / picked.numel()
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.4, 0.3, 0.2]), rtol=0, atol=0.03)
    assert pick_tokens(logits[:3], 0.0, 1.0, None).tolist() == [1, 1, 1]


def test_compiled_the_pick_writes_nothing_as_wide_as_the_vocabulary():
    """Inductor's code for the pick (no nucleus filter) allocates only per-row, per-block and
    one-block buffers, and picks the eager (full-width) pick's tokens."""
    import re

    from torch._inductor.utils import run_and_get_code

    rows, vocab = 16, 20_000
    gen = torch.Generator().manual_seed(0)
    logits, draw = torch.randn(rows, vocab, generator=gen) * 3, torch.rand(rows, 1, generator=gen)
    compiled = torch.compile(lambda x, d: pick_tokens(x, 0.7, 1.0, d), dynamic=False)
    picked, codes = run_and_get_code(compiled, logits, draw)
    sizes = [eval(shape.replace(",", "*") or "1") for shape in  # noqa: S307 -- sizes from inductor's own code
             re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", "\n".join(codes))]
    assert sizes and max(sizes) <= rows * 1024, sizes
    ref, margin = full_width_reference(logits, 0.7, draw)
    eager = pick_tokens(logits, 0.7, 1.0, draw)  # the full-width pass
    assert torch.equal(picked[margin > 1e-6], ref[margin > 1e-6])
    assert torch.equal(eager[margin > 1e-6], ref[margin > 1e-6])
