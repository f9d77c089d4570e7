"""Exit rules: small callables that decide, after a backbone layer, whether to leave the backbone.

Rules compose in order, like transformers' ``LogitsProcessorList``: :class:`ExitRuleList` asks each
rule in turn and the first one that answers ``True`` (exit) or ``False`` (stay) decides; ``None``
means "no opinion, ask the next rule". When no rule decides, the forward pass stays on the backbone.

Every rule sees the same arguments:
    layer_idx (int): index of the backbone layer that just ran (0-based).
    hidden_in (Tensor): that layer's input hidden states, ``[batch, tokens, hidden]``, model dtype.
    hidden_out (Tensor): its output hidden states, same shape and dtype.
    token_mask (BoolTensor or None): ``[batch, tokens]``, ``True`` for real tokens; ``None`` when
        every position is real. Padding positions must not drive the decision.

``rule(...)`` decides for the whole batch (one answer). ``rule.per_row(...)`` decides per row
(route mode with a batch: each row leaves the backbone on its own tokens); it returns ``None`` (no
opinion for any row), a bool (the same answer for every row), or a ``[batch]`` sequence / bool
tensor of per-row answers (``None`` entries: no opinion for that row). The base class asks
``__call__`` once per row, so a rule that only defines ``__call__`` works per row too.
"""

from __future__ import annotations

import torch

from ..errors import RiverError

__all__ = [
    "ExitRule",
    "ExitRuleList",
    "MinLayerRule",
    "StateTransitionSimilarityRule",
    "state_transition_similarity",
    "row_similarity",
    "rules_from_config",
]


def state_transition_similarity(
    hidden_in: torch.Tensor, hidden_out: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cosine similarity between a layer's input and output hidden states, minimum over tokens.

    River-LLM (Sec. 3.2, "state transition similarity"): a layer whose output barely turns the
    hidden state is close to an identity map, so the remaining layers can run on the cheap exit
    path. The minimum over every token of the forward pass makes prefill decide once for the
    whole sequence and decode once per step.

    Args:
        hidden_in: ``[batch, tokens, hidden]``, any float dtype.
        hidden_out: same shape as ``hidden_in``.
        token_mask: optional ``[batch, tokens]`` bool; padding positions (``False``) are ignored.

    Returns:
        A 0-dim float32 tensor in [-1, 1]. Cost: O(batch x tokens x hidden).
    """
    return row_similarity(hidden_in, hidden_out, token_mask).amin()


def row_similarity(hidden_in: torch.Tensor, hidden_out: torch.Tensor,
                   token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The state transition similarity of each row: cosine of a layer's input and output hidden
    states, minimum over that row's real tokens (its padding never counts).

    Args: as :func:`state_transition_similarity`.

    Returns:
        ``[batch]`` float32; ``inf`` for a row with no real token in the pass (it holds nothing back).
    """
    cos = torch.nn.functional.cosine_similarity(hidden_in.float(), hidden_out.float(), dim=-1)
    if token_mask is not None:
        cos = cos.masked_fill(~token_mask, float("inf"))
    return cos.amin(dim=-1)


class ExitRule:
    """Base class of an exit rule. Subclasses implement ``__call__`` (see the module docstring)."""

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask) -> bool | None:  # pragma: no cover
        raise NotImplementedError

    def per_row(self, layer_idx, hidden_in, hidden_out, token_mask):
        """Per-row answers (see the module docstring); this default asks :meth:`__call__` once per
        row with that row's slices."""
        return [self(layer_idx, hidden_in[r:r + 1], hidden_out[r:r + 1],
                     None if token_mask is None else token_mask[r:r + 1]) for r in range(hidden_in.shape[0])]

    def to_dict(self) -> dict:
        """JSON-able settings; ``rules_from_config`` builds the rule back from them."""
        return {"type": type(self).__name__, **vars(self)}


class MinLayerRule(ExitRule):
    """Stay on the backbone until ``min_layer`` backbone layers have run (vetoes earlier exits).

    Early layers transform the hidden state most (on Qwen2.5 layer 0's similarity is about 0.06),
    and skipping the similarity there saves its cost.
    """

    def __init__(self, min_layer: int):
        if int(min_layer) < 1:
            raise ValueError(f"min_layer must be >= 1 (at least one backbone layer runs), got {min_layer}")
        self.min_layer = int(min_layer)

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask):
        return False if layer_idx + 1 < self.min_layer else None

    per_row = __call__  # the same answer for every row


class StateTransitionSimilarityRule(ExitRule):
    """Exit when the state transition similarity exceeds ``tau`` (River-LLM, Sec. 3.2).

    ``tau > 1`` can never be exceeded (cosine <= 1), so the rule answers ``False`` without computing
    anything: the model then runs exactly its unmodified backbone path.
    """

    def __init__(self, tau: float):
        self.tau = float(tau)

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask):
        if self.tau > 1.0:
            return False
        return bool(state_transition_similarity(hidden_in, hidden_out, token_mask) > self.tau)

    def per_row(self, layer_idx, hidden_in, hidden_out, token_mask):
        if self.tau > 1.0:
            return False
        return row_similarity(hidden_in, hidden_out, token_mask) > self.tau


class ExitRuleList(list):
    """Rules asked in order; the first ``True``/``False`` answer wins, default: stay."""

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask) -> bool:
        for rule in self:
            decision = rule(layer_idx, hidden_in, hidden_out, token_mask)
            if decision is not None:
                return decision
        return False

    def per_row(self, layer_idx, hidden_in, hidden_out, token_mask) -> list[bool]:
        """One decision per row (``[batch]`` bools, True: the row exits): for each row, the first
        rule with an answer for that row wins; default: stay. At batch 1 this is ``[self(...)]``."""
        batch = hidden_in.shape[0]
        decided: list = [None] * batch
        for rule in self:
            answer = rule.per_row(layer_idx, hidden_in, hidden_out, token_mask)
            if answer is None:
                continue
            if isinstance(answer, bool):
                answer = [answer] * batch
            elif isinstance(answer, torch.Tensor):
                answer = answer.tolist()
            decided = [d if d is not None else a for d, a in zip(decided, answer)]
            if all(d is not None for d in decided):
                break
        return [bool(d) for d in decided]  # None (no rule decided): stay

    def may_exit(self) -> bool:
        """False when no pass can ever leave the backbone under these rules: asked in order, every
        rule before the first :class:`StateTransitionSimilarityRule` with τ > 1 (which always
        answers False) is a :class:`MinLayerRule` (never True), or the list holds only those. Any
        other rule may answer True, so then True."""
        for rule in self:
            if type(rule) is MinLayerRule:
                continue
            return not (type(rule) is StateTransitionSimilarityRule and rule.tau > 1.0)
        return False

    def to_list(self) -> list[dict]:
        return [rule.to_dict() for rule in self]

    def with_tau(self, tau: float) -> ExitRuleList:
        """A new list in which every :class:`StateTransitionSimilarityRule` has threshold ``tau``;
        every other rule is kept as it is (the same object, in the same place).

        Raises:
            RiverError: the list holds no :class:`StateTransitionSimilarityRule`, so τ means nothing
                to it (say so explicitly: rebuild the rule list with one, or leave τ alone).
        """
        if not any(isinstance(rule, StateTransitionSimilarityRule) for rule in self):
            raise RiverError(
                f"the exit rules in force ({', '.join(type(r).__name__ for r in self) or 'none'}) hold no "
                "StateTransitionSimilarityRule, so there is no tau to change; set rules that include one "
                "(e.g. enable_river(model, rules=[MinLayerRule(2), StateTransitionSimilarityRule(0.9)]))"
            )
        return ExitRuleList(
            StateTransitionSimilarityRule(tau) if isinstance(rule, StateTransitionSimilarityRule) else rule
            for rule in self
        )


_RULE_TYPES = {cls.__name__: cls for cls in (MinLayerRule, StateTransitionSimilarityRule)}


def rules_from_config(items: list[dict]) -> ExitRuleList:
    """Build an :class:`ExitRuleList` from ``ExitRuleList.to_list()`` output.

    Raises:
        ValueError: an unknown rule type or bad arguments.
    """
    rules = ExitRuleList()
    for item in items:
        item = dict(item)
        kind = item.pop("type", None)
        if kind not in _RULE_TYPES:
            raise ValueError(f"unknown exit rule {kind!r}; known: {', '.join(_RULE_TYPES)}")
        rules.append(_RULE_TYPES[kind](**item))
    return rules
