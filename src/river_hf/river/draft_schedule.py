"""Draft-length schedules of lossless mode: how many drafts k the next round proposes.

A schedule is a registered strategy object (:func:`register_schedule`, :func:`make_schedule`),
one fresh instance per ``generate`` call, fed each round's outcome by whoever runs the rounds
(:class:`~river_hf.river.drafter.ExitPathDrafter` at batch 1, :mod:`.lossless_batch` for a batch):

- ``heuristic``: transformers' ``num_assistant_tokens_schedule="heuristic"`` (+2 after a round in
  which every draft was accepted, -1 otherwise);
- ``constant``: k never changes;
- ``cost``: the k that maximises expected tokens per unit of cost (Leviathan et al. 2023, *Fast
  Inference from Transformers via Speculative Decoding*, §3.4-3.5, generalised). A round of k
  drafts yields ``1 + S(1) + ... + S(k)`` tokens a row, ``S(j)`` being the probability that a
  row's first j drafts are all accepted, and costs ``k * c + v(rows * (k + 1))`` one-row backbone
  passes: ``c`` a draft pass's cost over a one-row backbone pass's (:func:`bytes_cost`: the weight
  bytes the call's draft passes read over a backbone pass's; decode on CPUs streams weights) and
  ``v(R)`` a verify pass of ``R`` rows over a one-row pass (the call's ``verify_cost``,
  :func:`~river_hf.river.verify_kernel.verify_row_costs`, measured once per machine; 1 for any R
  where not measured, and always for ``cost-flat``, as in the paper).
  ``S`` is the Kaplan-Meier (product-limit) estimate of the accepted run's length from the call's
  rounds (Kaplan & Meier 1958: a row that accepted all its drafts is censored there, one that
  stopped early is a rejection at the next draft), each position's rejection rate shrunk towards
  ``1 - α`` by :data:`PSEUDO_ROWS` pseudo-rows, α being the acceptance per draft with the Jeffreys
  prior (the Krichevsky-Trofimov estimate ``(accepted + 1/2) / (accepted + rejections + 1)``).
  With no round seen at a position it is the paper's i.i.d. model (``S(j) = α^j``: their Theorem
  3.8's ``(1 - α^(k+1)) / (1 - α)`` tokens), but acceptance comes in runs: on code, one row's
  rounds are often all accepted, where the i.i.d. model's α < 1 would shorten k. S, α and ``c``
  come from the tokens and ``v`` from a measurement taken once per machine before any call drafts,
  never from the call's own clock, so a seeded sampling call draws the same tokens every time.

Every schedule keeps k within ``[1, most]``; the first round that drafts (after the prefill)
drafts ``first`` (``RiverConfig``'s ``draft_tokens``), fewer where an EOS or the length limit
ends it.
"""

from __future__ import annotations

from ..errors import RiverError

__all__ = ["DraftSchedule", "HeuristicSchedule", "ConstantSchedule", "CostSchedule", "FlatCostSchedule",
           "register_schedule",
           "make_schedule", "SCHEDULES", "expected_tokens_per_cost", "bytes_cost", "row_cost_curve", "PSEUDO_ROWS"]

#: the weight of the i.i.d. model in each position's rejection rate (``cost``), in rows
PSEUDO_ROWS = 1.0
#: the most k the ``cost`` schedule weighs (its ``most`` is lower by default: ``max_draft_tokens``)
_SCAN = 128
#: registered schedules by name (:func:`register_schedule`)
SCHEDULES: dict[str, type] = {}


def register_schedule(cls: type) -> type:
    """Register a :class:`DraftSchedule` subclass under its ``name`` (a class decorator)."""
    SCHEDULES[cls.name] = cls
    return cls


def make_schedule(name: str, first: int, most: int, verify_cost=None) -> "DraftSchedule":
    """A fresh schedule ``name`` for one call, starting at k = ``first``, never above ``most``;
    ``verify_cost(rows)`` (a verify pass of ``rows`` rows over a one-row backbone pass: a
    :func:`row_cost_curve`) or None (1 for any rows).

    Raises:
        RiverError: an unknown ``name``, or ``first`` / ``most`` not integers (bools refused) with
            1 <= first <= most.
    """
    cls = SCHEDULES.get(name)
    if cls is None:
        raise RiverError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (first, most)) or not 1 <= first <= most:
        raise RiverError(f"a draft schedule needs 1 <= first ({first!r}) <= most ({most!r})")
    return cls(first, most, verify_cost)


def row_cost_curve(points):
    """``v(rows)``: the piecewise-linear interpolation of ``points`` (``((rows, cost), ...)``, at
    least two, rows ascending), extended past either end along its end segment, never below 0."""
    points = tuple(sorted((int(r), float(c)) for r, c in points))
    if len(points) < 2 or len({r for r, _ in points}) != len(points):
        raise ValueError(f"a row cost curve needs two or more distinct row counts, got {points!r}")

    def cost(rows: int) -> float:
        i = 1
        while i < len(points) - 1 and rows > points[i][0]:
            i += 1
        (r0, c0), (r1, c1) = points[i - 1], points[i]
        return max(0.0, c0 + (c1 - c0) * (rows - r0) / (r1 - r0))

    cost.points = points
    return cost


def _flat(rows: int) -> float:
    return 1.0


class DraftSchedule:
    """Base class: ``k`` (the next round's drafts) and :meth:`update` with a round's outcome;
    ``verify_cost`` as for :func:`make_schedule`."""

    name = ""

    def __init__(self, first: int, most: int, verify_cost=None):
        self.k = first
        self.most = most
        self.verify_cost = verify_cost or _flat

    def update(self, accepted: list[int], judged: list[int], draft_passes: int, draft_cost: float) -> int:
        """Take one round's outcome and return the next k.

        Args:
            accepted: drafts each live row accepted (batch 1: one entry; its length is the rows
                the next verify pass judges for).
            judged: drafts each of those rows had judged (its drafts, cut at its length limit).
            draft_passes: the round's draft forward passes.
            draft_cost: what they cost in verify passes (:func:`bytes_cost`).
        """
        raise NotImplementedError


def bytes_cost(model, exit_layers: list[int]) -> float:
    """The cost of draft passes that left the backbone at ``exit_layers`` (one entry per pass) in
    verify passes: the sum of the weight bytes each read (``model.river_step_bytes(e)``) over the
    bytes of one pass on the backbone (``model.river_step_bytes(L)``)."""
    full = model.river_step_bytes(model.river.num_layers)
    return sum(model.river_step_bytes(e) for e in exit_layers) / full


@register_schedule
class HeuristicSchedule(DraftSchedule):
    """transformers' ``heuristic`` schedule: +2 when every row accepted every draft it judged, else -1."""

    name = "heuristic"

    def update(self, accepted, judged, draft_passes, draft_cost) -> int:
        full = all(a == j for a, j in zip(accepted, judged))
        self.k = min(self.k + 2, self.most) if full else max(1, self.k - 1)
        return self.k


@register_schedule
class ConstantSchedule(DraftSchedule):
    """k stays ``first`` (a round cut short by an EOS or the length limit does not change it)."""

    name = "constant"

    def update(self, accepted, judged, draft_passes, draft_cost) -> int:
        return self.k


def expected_tokens_per_cost(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Tokens a round of ``k`` drafts yields per row and per one-row backbone pass's time
    (Leviathan et al. 2023, §3.5): ``(1 - alpha^(k+1)) / ((1 - alpha) (k c + v))``, ``alpha`` in
    [0, 1) the acceptance probability of one draft, ``c`` >= 0 a draft pass's time and ``v`` > 0
    the verify pass's (1 in the paper) over a one-row backbone pass's: the ``cost`` schedule's
    rate before it has seen a round at any of the k positions (``S(j) = alpha^j``)."""
    return (1.0 - alpha ** (k + 1)) / ((1.0 - alpha) * (k * c + v))


@register_schedule
class CostSchedule(DraftSchedule):
    """The k with the most expected tokens per unit of cost (module docstring: Leviathan et al.
    2023 §3.5 with a Kaplan-Meier acceptance model, ``c`` from the draft passes' weight bytes,
    the verify's cost ``v`` at the rows it will have: the live rows times k + 1)."""

    name = "cost"

    def __init__(self, first: int, most: int, verify_cost=None):
        super().__init__(first, most, verify_cost)
        self.accepted = self.rejections = self.passes = 0
        self.draft_cost = 0.0
        self.reached: list[int] = []  # [j - 1]: rows that judged draft j
        self.rejected: list[int] = []  # [j - 1]: rows whose draft j was rejected

    @property
    def alpha(self) -> float:
        """The acceptance probability per draft so far (Krichevsky-Trofimov: the Jeffreys prior)."""
        return (self.accepted + 0.5) / (self.accepted + self.rejections + 1)

    def survival(self, k: int) -> list[float]:
        """``[S(1), ..., S(k)]``: the probability that a row's first j drafts are all accepted
        (product-limit, each position's rejection rate ``(rejected + PSEUDO_ROWS (1 - α)) /
        (reached + PSEUDO_ROWS)``)."""
        q, s, out = 1.0 - self.alpha, 1.0, []
        for j in range(k):
            reached = self.reached[j] if j < len(self.reached) else 0
            rejected = self.rejected[j] if j < len(self.rejected) else 0
            s *= 1.0 - (rejected + PSEUDO_ROWS * q) / (reached + PSEUDO_ROWS)
            out.append(s)
        return out

    def update(self, accepted, judged, draft_passes, draft_cost) -> int:
        for a, j in zip(accepted, judged):
            if j > len(self.reached):
                grow = j - len(self.reached)
                self.reached += [0] * grow
                self.rejected += [0] * grow
            for i in range(min(a + 1, j)):
                self.reached[i] += 1
            if a < j:
                self.rejected[a] += 1
        self.accepted += sum(accepted)
        self.rejections += sum(a < j for a, j in zip(accepted, judged))
        self.passes += draft_passes
        self.draft_cost += draft_cost
        if self.passes == 0:
            return self.k
        c, rows = self.draft_cost / self.passes, max(1, len(accepted))
        tokens, best, self.k = 1.0, -1.0, 1
        for k, s in enumerate(self.survival(min(self.most, _SCAN)), start=1):
            tokens += s
            rate = tokens / (k * c + self.verify_cost(rows * (k + 1)))
            if rate > best:
                best, self.k = rate, k
        return self.k


@register_schedule
class FlatCostSchedule(CostSchedule):
    """The ``cost`` rule as published (Leviathan et al. 2023, §3.5): a verify pass costs one pass
    whatever its rows (``verify_cost`` ignored), so k does not shrink as a batch's verify rows
    grow."""

    name = "cost-flat"

    def __init__(self, first: int, most: int, verify_cost=None):
        super().__init__(first, most, None)
