"""Draft-length schedules of lossless mode: how many drafts k the next round proposes.

A schedule is a registered strategy object (:func:`register_schedule`, :func:`make_schedule`),
one fresh instance per ``generate`` call, fed each round's outcome by whoever runs the rounds
(:class:`~river_hf.river.drafter.ExitPathDrafter` at batch 1, :mod:`.lossless_batch` for a batch):

- ``heuristic``: transformers' ``num_assistant_tokens_schedule="heuristic"`` (+2 after a round in
  which every draft was accepted, -1 otherwise);
- ``constant``: k never changes;
- ``cost``: the k that maximises expected tokens per second under the i.i.d. acceptance model of
  Leviathan et al. 2023 (*Fast Inference from Transformers via Speculative Decoding*, §3.4-3.5):
  a round of k drafts yields ``(1 - α^(k+1)) / (1 - α)`` tokens (Theorem 3.8) and costs
  ``k * c + 1`` verify passes' time, ``c`` being a draft pass's time over a verify pass's.
  α is the acceptance probability per draft token estimated by Laplace's rule of succession,
  ``(accepted + 1) / (accepted + rejections + 2)`` (a rejection: a round that stopped before its
  last draft), and ``c`` the call's own measured draft and verify seconds so far (both taken in
  the same call, so a busy machine slows both alike). k stays between 1 and the call's most.

Every schedule keeps k within ``[1, most]``; the first round drafts ``first`` (``RiverConfig``'s
``draft_tokens``).
"""

from __future__ import annotations

from ..errors import RiverError

__all__ = ["DraftSchedule", "HeuristicSchedule", "ConstantSchedule", "CostSchedule", "register_schedule",
           "make_schedule", "SCHEDULES", "expected_tokens_per_cost"]

#: registered schedules by name (:func:`register_schedule`)
SCHEDULES: dict[str, type] = {}


def register_schedule(cls: type) -> type:
    """Register a :class:`DraftSchedule` subclass under its ``name`` (a class decorator)."""
    SCHEDULES[cls.name] = cls
    return cls


def make_schedule(name: str, first: int, most: int) -> "DraftSchedule":
    """A fresh schedule ``name`` for one call, starting at k = ``first``, never above ``most``.

    Raises:
        RiverError: an unknown ``name``, or ``first`` / ``most`` not integers with 1 <= first <= most.
    """
    cls = SCHEDULES.get(name)
    if cls is None:
        raise RiverError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if not isinstance(first, int) or not isinstance(most, int) or not 1 <= first <= most:
        raise RiverError(f"a draft schedule needs 1 <= first ({first!r}) <= most ({most!r})")
    return cls(first, most)


class DraftSchedule:
    """Base class: ``k`` (the next round's drafts) and :meth:`update` with a round's outcome."""

    name = ""

    def __init__(self, first: int, most: int):
        self.k = first
        self.most = most

    def update(self, accepted: list[int], judged: list[int], draft_seconds: float, draft_passes: int,
               verify_seconds: float) -> int:
        """Take one round's outcome and return the next k.

        Args:
            accepted: drafts each live row accepted (batch 1: one entry).
            judged: drafts each of those rows had judged (its drafts, cut at its length limit).
            draft_seconds: wall seconds the round spent drafting; ``draft_passes`` draft forward passes.
            verify_seconds: wall seconds of the round's verify (forward pass and acceptance).
        """
        raise NotImplementedError


@register_schedule
class HeuristicSchedule(DraftSchedule):
    """transformers' ``heuristic`` schedule: +2 when every row accepted every draft it judged, else -1."""

    name = "heuristic"

    def update(self, accepted, judged, draft_seconds, draft_passes, verify_seconds) -> int:
        full = all(a == j for a, j in zip(accepted, judged))
        self.k = min(self.k + 2, self.most) if full else max(1, self.k - 1)
        return self.k


@register_schedule
class ConstantSchedule(DraftSchedule):
    """k stays what the first round drafted."""

    name = "constant"

    def update(self, accepted, judged, draft_seconds, draft_passes, verify_seconds) -> int:
        return self.k


def expected_tokens_per_cost(alpha: float, k: int, c: float) -> float:
    """Tokens a round of ``k`` drafts yields per verify pass's time (Leviathan et al. 2023, §3.5):
    ``(1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))``, ``alpha`` in [0, 1) the acceptance probability
    of one draft, ``c`` >= 0 a draft pass's time over a verify pass's."""
    return (1.0 - alpha ** (k + 1)) / ((1.0 - alpha) * (k * c + 1.0))


@register_schedule
class CostSchedule(DraftSchedule):
    """The k with the most expected tokens per second (module docstring: Leviathan et al. 2023 §3.5,
    α by Laplace's rule of succession, ``c`` from the call's measured seconds)."""

    name = "cost"

    def __init__(self, first: int, most: int):
        super().__init__(first, most)
        self.accepted = self.rejections = self.passes = self.verifies = 0
        self.draft_seconds = self.verify_seconds = 0.0

    @property
    def alpha(self) -> float:
        """The acceptance probability per draft so far (Laplace's rule of succession)."""
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)

    def update(self, accepted, judged, draft_seconds, draft_passes, verify_seconds) -> int:
        self.accepted += sum(accepted)
        self.rejections += sum(a < j for a, j in zip(accepted, judged))
        self.passes += draft_passes
        self.verifies += 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        if self.passes == 0 or self.verify_seconds <= 0.0:
            return self.k
        c = (self.draft_seconds / self.passes) / (self.verify_seconds / self.verifies)
        alpha, k = self.alpha, 1
        # the ratio of a concave numerator to a positive affine denominator rises, then falls: climb
        while k < self.most and expected_tokens_per_cost(alpha, k + 1, c) > expected_tokens_per_cost(alpha, k, c):
            k += 1
        self.k = k
        return self.k
