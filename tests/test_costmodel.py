"""The one speculative speed formula that drafting, the planner and bench share."""
import pytest

from ggufspec import costmodel as C
from ggufspec.bench import predicted_speedup
from ggufspec.costs import Costs
from ggufspec.drafting import AdaptiveK


def test_expected_tokens_is_the_geometric_sum():
    assert C.expected_tokens(0.0, 4) == 1
    assert C.expected_tokens(1.0, 4) == 5
    assert C.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_k_zero_is_the_target_alone():
    assert C.tokens_per_second(0, 0.7, 0.01, 0.05) == 1 / 0.05
    assert C.speedup(0, 0.7, 0.01, 0.05, 0.05) == 1.0


def test_speedup_is_the_rate_against_the_target_alone():
    rate = C.tokens_per_second(3, 0.8, 0.004, 0.06)
    assert C.speedup(3, 0.8, 0.004, 0.06, 0.05) == pytest.approx(rate * 0.05)
    assert rate == pytest.approx((1 + 0.8 + 0.64 + 0.512) / (3 * 0.004 + 0.06))


@pytest.mark.parametrize("a, k", [(0.1, 1), (0.7, 3), (0.95, 8)])
def test_acceptance_from_tokens_per_step_inverts_expected_tokens(a, k):
    assert C.acceptance_from_tokens_per_step(C.expected_tokens(a, k), k) == pytest.approx(a, abs=1e-9)


def test_drafting_and_bench_use_the_same_formula():
    costs = Costs()
    for k, verify in ((0, 0.05), (0, 0.05), (2, 0.055), (4, 0.06), (4, 0.06)):
        costs.observe(k, 0.004 * k, verify)
    controller = AdaptiveK(costs=costs)
    a, batch = min(controller.acceptance, 0.999), costs.batch_model()
    rates = controller.rates(4)
    assert rates[0] == 1 / batch(1)
    assert rates[4] == C.tokens_per_second(4, a, costs.t_draft, batch(5))
    figures = {"draft_1": costs.t_draft, "target_1": batch(1), "target_5": batch(5)}
    assert predicted_speedup(figures, 4, a) == pytest.approx(rates[4] * batch(1))
