"""e4m3 rounding inside kernels (kernels/e4m3.py) against torch's float8_e4m3fn cast: the integer
rounding on the CPU (Triton interpreter) and on a GPU, the hardware cast on a GPU (marked gpu)."""

import pytest
import torch
import triton
import triton.language as tl

from minidecode.kernels.e4m3 import split_e4m3, to_e4m3

N = 4096
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
ROUNDINGS = [
    pytest.param(False, id="integer-ops"),
    pytest.param(
        True, id="hardware", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]
    ),
]


@triton.jit
def _round_kernel(X, Y, HI, LO, N: tl.constexpr, HW: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, to_e4m3(x, HW).to(tl.uint8, bitcast=True))
    hi, lo = split_e4m3(x, HW)
    tl.store(HI + offs, hi.to(tl.uint8, bitcast=True))
    tl.store(LO + offs, lo.to(tl.uint8, bitcast=True))


def sample() -> torch.Tensor:
    """[N] float32 in [-448, 448]: every e4m3 value, the ties halfway between neighbours (round to
    even), and random values across e4m3's normal and subnormal binades."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    n_rand = N - grid.numel() - ties.numel()
    rand = torch.exp2(torch.rand(n_rand, generator=gen) * 18 - 10) * torch.randn(n_rand, generator=gen).sign()
    return torch.cat([grid, ties, rand.clamp(-448, 448)])


def run(x: torch.Tensor, hw: bool) -> tuple[torch.Tensor, ...]:
    x = x.to(DEVICE)
    y, hi, lo = (torch.empty(N, dtype=torch.uint8, device=DEVICE) for _ in range(3))
    _round_kernel[(1,)](x, y, hi, lo, N=N, HW=hw)
    return tuple(t.cpu().view(torch.float8_e4m3fn).float() for t in (y, hi, lo))


@pytest.mark.parametrize("hw", ROUNDINGS)
def test_to_e4m3_rounds_as_torch(hw):
    x = sample()
    y = run(x, hw)[0]
    assert torch.equal(y, x.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("hw", ROUNDINGS)
def test_split_e4m3_keeps_bf16_precision(hw):
    """hi is x with 3 mantissa bits (exact in e4m3 for |x| >= 2^-6) and hi + lo is x within
    2^-8 of |x|, or 2^-10 absolute where the remainder falls among e4m3's subnormals."""
    x = sample()
    _, hi, lo = run(x, hw)
    normal = x.abs() >= 2**-6
    cut = (x.view(torch.int32) & -1048576).view(torch.float32)
    assert torch.equal(hi[normal], cut[normal])
    bound = torch.maximum(x.abs() * 2**-8, torch.full_like(x, 2**-10))
    assert ((hi + lo - x).abs() <= bound)[normal].all()
    # e4m3 alone is 2^-4 of |x|: the split is what keeps the products at bf16's precision
    alone = (x.to(torch.float8_e4m3fn).float() - x).abs() / x.abs()
    assert alone[normal].max() > 2**-5
