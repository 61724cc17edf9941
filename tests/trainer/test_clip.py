"""`molt.trainer.parallel.clip_grad_norm` against torch's reference `torch.nn.utils.clip_grad_norm_`: the same
total norm before clipping and the same clipped gradients, above and below the threshold, and no clipping at
max_norm 0."""

import pytest
import torch

from molt.trainer.parallel import clip_grad_norm


def _params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(7, 3), (5,), (2, 4, 3), (1,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: skipped by both
    return params


@pytest.mark.parametrize("scale, max_norm", [(1.0, 0.5), (0.01, 1.0), (3.0, 0.0)])
def test_clip_grad_norm_matches_torch(scale, max_norm):
    ours, ref = _params(0, scale), _params(0, scale)
    norm = clip_grad_norm(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm > 0 else float("inf"))
    assert norm == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(ours, ref):
        if b.grad is None:
            assert a.grad is None
        else:
            assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    if max_norm > 0 and float(want) > max_norm:  # clipping happened: the clipped norm is the threshold
        assert float(torch.cat([p.grad.flatten() for p in ours[:4]]).norm()) == pytest.approx(
            max_norm, rel=1e-5
        )
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0  # nothing to clip
