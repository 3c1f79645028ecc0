"""Stand-ins the unit tests share.

``QuietStage``: a decode stage (``rtvideo.workers.decode_stage.DecodeStages``) whose
``step_done``, ``forget`` and ``close`` do nothing and which decoded nothing on
any rank: a test's stage defines ``submit`` and what else it needs.

``HeldExecutor``: an ``rtvideo.engine.plan.Executor`` whose micro-steps run through a
real runner (``rtvideo.workers.runner.ModelRunner``) only when the test says
(``finish_oldest``), so a test holds the loop at any point between submitting
a micro-step and hearing its result. ``depth`` micro-steps are in flight at
once (the threaded executor holds two). With ``defer_decodes`` the runner
leaves each committed chunk's decode to the test, as it leaves it to the
decode stage: ``decode`` runs the oldest (the real one), ``answer`` makes it
come back as the test says.
"""

from __future__ import annotations

from rtvideo.engine.messages import RankFigures
from rtvideo.engine.plan import DecodeResult, MicroStep, StepResult
from rtvideo.workers.runner import ModelRunner


class QuietStage:
    decodes: tuple[int, ...] | list[int] = ()

    def submit(self, session_id: str, chunk_index: int) -> None:
        raise NotImplementedError

    def step_done(self, idle: bool) -> None:
        pass

    def forget(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class HeldExecutor:
    def __init__(
        self, runner: ModelRunner, depth: int = 1, defer_decodes: bool = False, figures: tuple[RankFigures, ...] = ()
    ) -> None:
        """``figures``: what ``rank_figures`` reports (() as one rank's executor does)."""
        self.depth = depth
        self.runner = runner
        if defer_decodes:
            runner.sessions.defer_decode = True
        self.figures = figures
        self.submitted: list[MicroStep] = []  # every micro-step submitted, in order
        self.waiting: list[MicroStep] = []  # submitted, not run yet
        self.done: list[StepResult | DecodeResult] = []  # run, not collected by the loop yet
        self.decodes: list[tuple[str, int]] = []  # committed, not decoded yet, in order

    def finish_oldest(self) -> MicroStep:
        """Run the oldest micro-step in flight; its result waits for the loop."""
        step = self.waiting.pop(0)
        result = self.runner.execute(step)
        self.done.append(result)
        self.decodes.extend(result.decodes)
        return step

    def decode(self) -> None:
        """Decode the oldest deferred chunk (the runner's real decode)."""
        self.done.append(self.runner.sessions.decode(*self.decodes.pop(0)))

    def answer(self, result: DecodeResult) -> None:
        """The oldest deferred decode comes back as ``result`` (the decode stage's answer)."""
        session_id, _ = self.decodes.pop(0)
        self.runner.sessions.decode_returned(session_id)
        self.done.append(result)

    # -- engine.plan.Executor -------------------------------------------------

    def submit(self, step: MicroStep) -> None:
        self.submitted.append(step)
        self.waiting.append(step)

    def results(self) -> list[StepResult | DecodeResult]:
        done, self.done = self.done, []
        return done

    def in_flight(self) -> int:
        return len(self.waiting) + sum(isinstance(r, StepResult) for r in self.done)

    def executing_s(self) -> float:
        return 0.0

    def held_sessions(self):
        return self.runner.held_sessions()

    def rank_figures(self) -> tuple[RankFigures, ...]:
        return self.figures

    def close(self) -> None:
        pass
