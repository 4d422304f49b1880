"""The gradient norms: the host's sum of squares (infinity/csrc/norms.h) against an fp64
reference on every instruction set, and the overflow check and global norm of
infinity/_grad_norms.py against torch's ([Note: gradient norms])."""

from __future__ import annotations

import pytest
import torch

from infinity import _compact
from infinity._grad_norms import GradNorms


def _native():
    native = _compact.native_module()
    if native is None:
        pytest.skip("infinity._compact_native was not built (no C++ compiler at install, or INFINITY_BUILD_NATIVE=0)")
    return native


@pytest.mark.parametrize("n", [0, 1, 31, 511, 512, 513, 4096 + 7, 100_003])
def test_sum_squares_is_the_fp64_sum_to_1e7_and_the_same_bits_on_every_instruction_set(isa, n):
    native = _native()
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).exp()  # magnitudes spread over e
    got = native.sum_squares(x.data_ptr(), n)
    exact = float(x.double().square().sum())
    assert got == pytest.approx(exact, rel=1e-7, abs=0)
    best = native.isa()
    native.set_isa("scalar")
    try:
        assert native.sum_squares(x.data_ptr(), n) == got  # bit for bit
    finally:
        native.set_isa(best)


def test_a_host_gradient_s_norm_is_its_sum_of_squares_and_the_rest_torch_s_norm():
    """Contiguous fp32 host gradients keep a float; a strided one keeps torch's norm as a
    tensor; the global norm adds both up, within 1e-7 of the fp64 norm of all."""
    _native()
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g), torch.randn(64, 64, generator=g).t().reshape(-1)[::2],
             torch.randn(70_000, generator=g)]  # fmt: skip
    norms = GradNorms()
    for i, grad in enumerate(grads):
        norms.note(i, grad)
    kinds = [type(v) for v in norms._norms.values()]
    assert kinds == [float, torch.Tensor, float]
    exact = float(torch.cat([x.double().reshape(-1) for x in grads]).norm())
    assert norms.global_norm() == pytest.approx(exact, rel=1e-7)
    assert norms.all_finite()


@pytest.mark.parametrize("where", ["float", "tensor"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 2e19, 1e19], ids=["inf", "nan", "past-fp32", "within"])
def test_a_gradient_is_finite_exactly_when_torch_s_fp32_norm_is(where, value):
    """Every element finite but the squares past fp32's range (2e19 squared twice) is an
    overflow, as torch's fp32 norm is inf there; the sum of squares (a float) and a norm kept
    as a tensor (a strided gradient) agree with it."""
    _native()
    grad = torch.full((4, 2), 1.0)
    grad[0, 0] = value
    grad[1, 0] = value if value == 2e19 else 1.0
    noted = grad.t().reshape(-1) if where == "float" else grad.t()[0]  # contiguous, or strided
    norms = GradNorms()
    norms.note(0, torch.ones(16))
    norms.note(1, noted)
    assert isinstance(norms._norms[1], float) == (where == "float")
    expected = bool(torch.isfinite(torch.linalg.vector_norm(noted)))
    assert expected == (value == 1e19)
    assert norms.all_finite() == expected
