"""The worker restart budget: at most N starts tried in any window, failed ones counted."""

from rtvideo.engine.client.restart_budget import RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_allows_n_starts_within_a_window_and_frees_them_as_they_age() -> None:
    clock = Clock()
    budget = RestartBudget(max_restarts=2, window_s=60.0, clock=clock)
    assert budget.allows() and budget.left == 2
    assert budget.spend() == 1
    clock.now += 10
    assert budget.spend() == 2
    assert not budget.allows() and budget.left == 0
    clock.now += 50  # the first start is now exactly window_s old: out of the window
    assert budget.allows() and budget.left == 1
    clock.now += 10  # and the second
    assert budget.left == 2
    assert budget.spend() == 1  # the count is of the starts within the window
    assert "2 restarts tried in the last 60 s" in budget.spent_reason()


def test_no_restarts_at_zero_and_the_reason_says_they_are_off() -> None:
    budget = RestartBudget(max_restarts=0, window_s=300.0, clock=Clock())
    assert not budget.allows() and budget.left == 0
    assert budget.spent_reason() == "restarts are off (max_worker_restarts is 0)"
