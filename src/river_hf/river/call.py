"""One ``generate`` call on a River model, as one object: :class:`GenerateCall`.

:meth:`~river_hf.river.modeling.RiverForCausalLM.generate` makes one per call and puts it in
flight with :meth:`RiverRouter.calling <river_hf.river.layer.RiverRouter.calling>` for the
duration of the call; whatever transformers calls back into River during the call (the
generation hooks ``river_candidate_generator`` / ``river_stopping_criteria``, the model's forward
hooks) finds it through the one accessor :attr:`RiverRouter.current_call
<river_hf.river.layer.RiverRouter.current_call>` (per thread: two threads generating on one model
each see their own call). What one forward pass decides (its exit layer, its rows) is not here:
that stays with the router.

A lossless call's state goes one way: ``generate`` fills the call (:func:`~river_hf.river.lossless.lossless_call`:
record, verify kernel, draft settings), the drafter and the batched loop read and fill it, the
stopping-criteria hook leaves its :class:`~river_hf.river.lossless.FirstStop` on it, and
``generate`` reads that back after the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GenerateCall"]


@dataclass
class GenerateCall:
    """What one ``generate`` call carries from its start to its end.

    Attributes:
        lossless: whether the call drafts and verifies (lossless mode, and a call
            :func:`~river_hf.river.lossless_generate.can_draft` accepted); False for every other call.
        record: the lossless statistics the drafter or the batched loop accumulate (counts, seconds,
            draft exit layers; read by :meth:`ExitPathDrafter.stats
            <river_hf.river.drafter.ExitPathDrafter.stats>`); empty outside lossless mode.
        verify_linear: the ``TorchFunctionMode`` the call's backbone passes (prefill, verify) run
            their Linears in (:func:`~river_hf.river.verify_kernel.verify_mode`), None: plain ``F.linear``.
        draft_settings: the drafter's keyword arguments from the model's config
            (:func:`~river_hf.river.lossless.draft_settings`: ``draft_path``, ``draft_rules``,
            ``draft_head``, ``prompt_lookup_rule``); empty outside lossless mode.
        first_stop: the :class:`~river_hf.river.lossless.FirstStop` the call's stopping criteria
            were wrapped in (a batch-1 lossless call), None otherwise; ``generate`` cuts its output
            at ``first_stop.stop_at``.
        backbone_linear: the ``TorchFunctionMode`` a route-mode call's backbone layers and original
            LM head run their Linears in (:func:`~river_hf.river.verify_kernel.backbone_mode`), None:
            plain ``F.linear``. backbone_kernel: what that function said (reported in ``river_stats``).
    """

    lossless: bool = False
    record: dict = field(default_factory=dict)
    verify_linear: object | None = None
    draft_settings: dict = field(default_factory=dict)
    first_stop: object | None = None
    backbone_linear: object | None = None
    backbone_kernel: dict | None = None

    @property
    def draft_path(self) -> str:
        """``route`` or ``exit`` (:data:`~river_hf.river.config.DRAFT_PATHS`): how the drafts run."""
        return self.draft_settings.get("draft_path", "route")
