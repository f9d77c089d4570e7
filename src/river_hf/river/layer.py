"""Per-layer routing: each decoder layer sends the hidden state to its backbone or its exit copy.

The architecture's own decoder loop, masks, rotary embeddings and cache calls stay untouched;
River only replaces each entry of the model's layer list with a :class:`RiverLayer` that holds the
original layer (backbone) and its quantized copy (exit layer). Both carry the same ``layer_idx``,
so whichever runs reads and writes that layer's slot of the one KV cache (River-LLM "KV share":
a token that left the backbone early still leaves complete KV for every later token).

The LM head is wrapped the same way (:class:`RiverHead`): a step whose forward pass left the
backbone reads its logits through the quantized *exit head*, a step that stayed on the backbone
through the original head (so τ > 1 stays token-identical to the unmodified model). Both wrappers
speak the architecture's names (``state_dict``, ``named_modules``; :mod:`.wrapping`).

One :class:`RiverRouter` per model holds the exit decision of the forward pass in flight, per thread
(the state of one call lives with that call, not on the shared model).

In a batch, each row exits on its own tokens (strategies with ``per_row``, on a cache that
:func:`~river_hf.river.rows.splittable` accepts): once rows disagree, each layer runs its backbone
on the rows still on it and the strategy on the rows that left, and the head reads each row
through its own head. While all rows agree (always at batch 1) nothing is gathered or scattered.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch import nn

from .controllers import ExitRuleList
from .rows import rows_kwargs, splittable, take_rows
from .strategies import ExitStrategy, get_strategy
from .wrapping import ReadsThroughToBackbone, exit_modules

__all__ = ["RiverRouter", "RiverLayer", "RiverHead", "exit_modules", "ROUTE", "BACKBONE_ONLY", "EXIT_ONLY", "LOSSLESS", "MODES",
           "PREFILL_POLICIES"]

ROUTE, BACKBONE_ONLY, EXIT_ONLY, LOSSLESS = "route", "backbone", "exit", "lossless"
#: Router modes. ``route``: River (exit when the rules say so); ``backbone``: never exit (the
#: unmodified model); ``exit``: every layer its exit copy (the fully quantized model); ``lossless``:
#: passes run on the backbone (verify, prefill) except the drafts, which the drafter of
#: :mod:`.lossless` runs inside ``override(mode="route")``.
MODES = (ROUTE, BACKBONE_ONLY, EXIT_ONLY, LOSSLESS)
#: ``route``: a multi-token pass (prefill) takes the exit decision once for the whole sequence
#: (River-LLM's sequence-level exit); ``backbone``: it always runs on the backbone (exact KV for
#: the prompt), and only one-token decode steps may exit.
PREFILL_POLICIES = ("route", "backbone")
_EXIT_LAYERS = get_strategy("river")


class _ThreadState(threading.local):
    """What one thread's calls into a River model hold: the pass in flight, the overrides of the
    calls it is inside (``river_mode``, a per-call τ), the log of the call being recorded, and
    which ``generate`` call is in flight (its :class:`~river_hf.river.call.GenerateCall`, through
    :attr:`RiverRouter.current_call`). A fresh instance per thread, so two threads that generate on
    one model never see each other's routing decisions (``threading.local``)."""

    def __init__(self):
        self.mode: str | None = None  # override of the router's mode (river_mode), None: the router's own
        self.rules: ExitRuleList | None = None  # override of the router's rules (per-call τ), None: its own
        self.strategy: ExitStrategy | None = None  # override of the router's strategy, None: its own
        self.decode_pass = False  # the next pass is a decode step even with several tokens (Recompute)
        self.full_depth = False  # the next pass runs every layer (Recompute's re-fed pass)
        self.log: list | None = None  # the recording call's pass log, None: nothing records
        self.next_mask = None
        self.call = None  # the GenerateCall in flight (RiverRouter.calling), None: no generate call
        self.stats = None  # river_summary of this thread's last generate call
        self.reset_pass(ROUTE, 0)

    def reset_pass(self, mode: str, num_layers: int, strategy: ExitStrategy | None = None) -> None:
        self.stay = mode in (BACKBONE_ONLY, LOSSLESS)
        self.exited = mode == EXIT_ONLY
        self.exit_layer = 0 if self.exited else num_layers
        self.cap = num_layers  # deepest exit layer this pass may have (SkipDecode)
        # what the layers after the exit run: the exit copies in "exit" mode (the fully quantized model)
        self.pass_strategy = _EXIT_LAYERS if self.exited or strategy is None else strategy
        self.stacked = 0  # layers below this index already ran in an exit stack this pass (FusedLlamaLayer)
        self.mask = None
        self.token_mask = None
        self.per_row = False  # rows may exit at different layers in this pass
        self.row_exits: list[int] | None = None  # per-row exit layers once rows disagreed, else None
        self.backbone_rows: torch.Tensor | None = None  # once rows disagreed: rows still on the backbone
        self.exit_rows: torch.Tensor | None = None  # ... and rows that left it (ascending long tensors)


class RiverRouter:
    """The exit decision of the forward pass in flight, kept per thread.

    The settings (``rules``, ``mode``, ``prefill``, ``num_layers``) are shared by every caller of
    the model. Everything that one forward pass or one ``generate`` call changes (whether the pass
    has exited, its exit layer, its padding mask, the per-call overrides of :meth:`override`, the
    log of :meth:`recording`) lives in a ``threading.local``: two threads generating on one model
    each get the tokens they would get alone.

    Attributes:
        rules: the :class:`ExitRuleList` asked after each backbone layer (reading it inside a
            :meth:`override` gives the override in force for this thread).
        strategy: the :class:`~river_hf.river.strategies.ExitStrategy` that says what the layers
            after the exit do (River's exit layers, or a baseline); per thread inside :meth:`override`.
        num_layers: number of decoder layers L.
        mode: one of :data:`MODES`; per thread inside :meth:`override`.
        prefill: how multi-token passes are routed (:data:`PREFILL_POLICIES`).
        exited: whether the pass in flight (this thread's) has left the backbone.
        exit_layer: for this thread's pass in flight, index of the first layer served by its exit
            copy (= number of backbone layers run); L when the pass never left the backbone. In a
            batch whose rows exited at different layers: the deepest row's (L when a row stayed).
        row_exit_layers: the exit layer of each row of the pass in flight (a list of ints).
    """

    def __init__(self, rules: ExitRuleList, num_layers: int, prefill: str = "route", strategy="river"):
        self._rules = rules
        self._strategy = get_strategy(strategy)
        self._mode = ROUTE
        self.num_layers = num_layers
        self.prefill = prefill
        self._local = _ThreadState()
        self._last_stats: dict = {}
        #: the model's decoder ``nn.ModuleList`` itself (set by the build; read live, so a layer swapped in
        #: later is seen), for exit stacks: the RiverLayers after the first exit layer
        self.layers: nn.ModuleList = nn.ModuleList()

    # -- settings (shared), with this thread's overrides ---------------------------------------

    @property
    def rules(self) -> ExitRuleList:
        return self._local.rules if self._local.rules is not None else self._rules

    @rules.setter
    def rules(self, rules: ExitRuleList) -> None:
        self._rules = rules

    @property
    def mode(self) -> str:
        return self._local.mode if self._local.mode is not None else self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self._mode = mode

    @property
    def strategy(self) -> ExitStrategy:
        return self._local.strategy if self._local.strategy is not None else self._strategy

    @strategy.setter
    def strategy(self, strategy) -> None:
        self._strategy = get_strategy(strategy)

    @property
    def exited(self) -> bool:
        return self._local.exited

    @property
    def exit_layer(self) -> int:
        return self._local.exit_layer

    @property
    def stacked_layers(self) -> int:
        """How many decoder layers this thread's pass in flight ran in one exit stack so far (0: none)."""
        return self._local.stacked

    def row_exit_layers(self, batch: int) -> list[int]:
        """Exit layer of each of the ``batch`` rows of this thread's pass in flight."""
        local = self._local
        return list(local.row_exits) if local.row_exits is not None else [local.exit_layer] * batch

    @contextlib.contextmanager
    def override(self, *, mode: str | None = None, rules: ExitRuleList | None = None, strategy=None):
        """Within the block, this thread's passes use ``mode``, ``rules`` and/or ``strategy`` (a
        name or object; None: unchanged); other threads keep theirs. Nests; the previous
        overrides come back on exit.

        Raises:
            RiverError: an unknown strategy name."""
        local = self._local
        old = local.mode, local.rules, local.strategy
        local.mode = mode if mode is not None else local.mode
        local.rules = rules if rules is not None else local.rules
        local.strategy = get_strategy(strategy) if strategy is not None else local.strategy
        try:
            yield self
        finally:
            local.mode, local.rules, local.strategy = old

    @contextlib.contextmanager
    def recording(self):
        """Within the block, this thread's forward passes are logged into the yielded list, one
        ``(batch, tokens, exit_layer, end_time)`` tuple per pass (``end_time``:
        ``time.perf_counter()`` seconds when it finished). Outside a recording nothing is kept, so
        forward-only loops grow no log. Nests: an inner recording gets its own list.

        Each tuple has a fifth entry, the exit layer of each row (a tuple of ``batch`` ints; in a
        batch whose rows exited at different layers ``exit_layer`` is the deepest of them)."""
        local = self._local
        old, local.log = local.log, []
        try:
            yield local.log
        finally:
            local.log = old

    @contextlib.contextmanager
    def calling(self, call):
        """Within the block, ``call`` (a :class:`~river_hf.river.call.GenerateCall`) is this
        thread's ``generate`` call in flight (:attr:`current_call`); ``generate`` opens it for its
        whole duration. Nests: the previous call comes back on exit."""
        local = self._local
        old, local.call = local.call, call
        try:
            yield call
        finally:
            local.call = old

    @property
    def current_call(self):
        """This thread's ``generate`` call in flight (a :class:`~river_hf.river.call.GenerateCall`),
        or None outside one (a bare forward pass): how the generation hooks and the model's forward
        hooks reach the call's state."""
        return self._local.call

    def remember(self, stats: dict) -> None:
        """Keep ``stats`` as this thread's last call's statistics (and as the model's last)."""
        self._local.stats = stats
        self._last_stats = stats

    def last_stats(self) -> dict:
        """This thread's last call's statistics, else the last call's of any thread, else ``{}``."""
        return self._local.stats if self._local.stats is not None else self._last_stats

    # -- one forward pass ----------------------------------------------------------------------

    def expect_padding_mask(self, attention_mask) -> None:
        """Give this thread's next forward pass its 2-D padding mask (``[batch, past+tokens]``, 1 or
        True for real tokens) ahead of time. ``generate`` turns the mask into a 4-D causal mask (or
        a dict of them) before the decoder stack sees it when the cache is a static one; River's
        model calls this from ``prepare_inputs_for_generation`` with the 2-D mask it started from."""
        is_2d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
        self._local.next_mask = attention_mask if is_2d else None

    def expect_decode_pass(self, full_depth: bool = False) -> None:
        """This thread's next forward pass is a decode step even if it has several tokens (the
        :class:`~river_hf.river.strategies.Recompute` strategy re-feeds exited tokens with the new
        one), so ``prefill="backbone"`` does not keep it on the backbone; ``full_depth``: the pass
        runs every layer (no exit)."""
        self._local.decode_pass = True
        self._local.full_depth = full_depth

    def begin(self, attention_mask, tokens: int = 1, cache=None, batch: int | None = None) -> None:
        """Start a forward pass of ``tokens`` new tokens per row (in this thread).

        Args:
            attention_mask: the mask the decoder stack got: 2-D ``[batch, past+tokens]`` (int or
                bool, nonzero = real token), or anything else (4-D, a dict, None), in which case
                the mask given by :meth:`expect_padding_mask` for this pass is used, if any; with
                neither, every position counts as real.
            tokens: new tokens per row in this pass.
            cache: the pass's KV cache (the strategy may cap the exit layer from it), or None.
            batch: rows in this pass (None: not known); at 1 the per-row machinery is not set up.

        Raises:
            RiverError: the strategy in force needs a dynamic cache and ``cache`` is another kind.
        """
        local = self._local
        mode = self.mode
        strategy = self.strategy if mode == ROUTE else None
        local.reset_pass(mode, self.num_layers, strategy)
        prefill = tokens > 1 and not local.decode_pass
        local.stay = local.stay or local.full_depth or (prefill and self.prefill == BACKBONE_ONLY)
        local.decode_pass = local.full_depth = False
        if strategy is not None and not strategy.runs_exit_layers:
            strategy.check_cache(cache)
            local.cap = strategy.exit_cap(cache, self.num_layers)
        local.per_row = (batch != 1 and strategy is not None and strategy.per_row and not local.stay
                         and splittable(cache))
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            local.mask = attention_mask
        else:
            local.mask = local.next_mask
        local.next_mask = None

    def after_backbone(self, layer_idx: int, hidden_in: torch.Tensor, hidden_out: torch.Tensor,
                       rows: torch.Tensor | None = None) -> None:
        """Ask the rules whether the layers after ``layer_idx`` run as exit layers.

        Args:
            layer_idx: the backbone layer that just ran.
            hidden_in, hidden_out: its input and output, ``[n, tokens, hidden]``.
            rows: the batch rows those ``n`` rows are (``[n]`` long, ascending), None: all rows.
        """
        local = self._local
        if local.stay or local.exited or layer_idx + 1 >= self.num_layers:
            return
        mask = self._tokens(hidden_in.shape[1])
        if layer_idx + 1 >= local.cap:
            votes = None  # every row exits
        elif local.per_row and (hidden_in.shape[0] > 1 or rows is not None):
            if rows is not None and mask is not None:
                mask = mask.index_select(0, rows.to(mask.device))
            votes = self.rules.per_row(layer_idx, hidden_in, hidden_out, mask)
            if not any(votes):
                return
            if not all(votes):
                self._rows_exit(layer_idx, hidden_in.shape[0], rows, votes, hidden_in.device)
                return
        elif self.rules(layer_idx, hidden_in, hidden_out, mask):
            votes = None
        else:
            return
        local.exited = True  # every row still on the backbone leaves it here
        local.exit_layer = layer_idx + 1
        if local.row_exits is not None:
            for r in local.backbone_rows.tolist():
                local.row_exits[r] = layer_idx + 1
            local.backbone_rows = local.exit_rows = None

    def _rows_exit(self, layer_idx: int, n: int, rows: torch.Tensor | None, votes: list[bool], device) -> None:
        """Some of the ``n`` backbone rows (``votes``: True for the rows that exit) leave it after
        ``layer_idx``; the first time in a pass (``rows`` None: the ``n`` rows are the batch) the
        pass starts splitting its rows."""
        local = self._local
        if rows is None:
            local.row_exits = [self.num_layers] * n
            rows_list, gone = list(range(n)), []
        else:
            rows_list, gone = rows.tolist(), local.exit_rows.tolist()
        for r, v in zip(rows_list, votes):
            if v:
                local.row_exits[r] = layer_idx + 1
        stay = [r for r, v in zip(rows_list, votes) if not v]
        gone = sorted(gone + [r for r, v in zip(rows_list, votes) if v])
        local.backbone_rows = torch.tensor(stay, dtype=torch.long, device=device)
        local.exit_rows = torch.tensor(gone, dtype=torch.long, device=device)

    def end(self, batch: int, tokens: int, cache=None) -> None:
        """Finish a forward pass: log it when a :meth:`recording` is open, and tell a
        :class:`RiverCache` who served each layer."""
        local = self._local
        local.stacked = 0  # a layer called outside a pass runs itself
        if local.log is not None:
            local.log.append((batch, tokens, local.exit_layer, time.perf_counter(), tuple(self.row_exit_layers(batch))))
        if hasattr(cache, "record_exit_layer"):
            cache.record_exit_layer(local.exit_layer, tokens, local.row_exits)

    def _tokens(self, n: int):
        local = self._local
        if local.mask is None:
            return None
        if local.token_mask is None or local.token_mask.shape[1] != n:
            m = local.mask[:, -n:].bool()
            local.token_mask = None if bool(m.all()) else m
            if local.token_mask is None:
                local.mask = None  # every position is real: no masking needed for this pass
        return local.token_mask


class RiverLayer(ReadsThroughToBackbone):
    """A decoder layer that runs its backbone, or, once the router has exited, what the strategy in
    force says (River: its exit copy; a baseline of :mod:`.strategies`: nothing, K/V only, ...).

    Called exactly like the wrapped decoder layer (same arguments, same return value). Attributes
    the model's decoder loop reads from its layers (``attention_type``, ``layer_idx``, ...) are
    looked up on the backbone.

    Args:
        backbone: the original decoder layer (kept as is, may be offloaded).
        exit_layer: its quantized copy, same ``layer_idx``.
        router: the model's shared :class:`RiverRouter`.
        layer_idx: position in the decoder stack.
    """

    _EXIT = "exit_layer"

    def __init__(self, backbone: nn.Module, exit_layer: nn.Module, router: RiverRouter, layer_idx: int):
        super().__init__()
        self.backbone = backbone
        self.exit_layer = exit_layer
        self.router = router
        self.river_layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        router = self.router
        local = router._local  # one thread-local lookup per layer
        strategy = local.pass_strategy
        if local.exited:
            if self.river_layer_idx < local.stacked:
                return hidden_states  # its exit layer ran in this pass's exit stack
            if strategy is _EXIT_LAYERS and getattr(self.exit_layer, "stacks", False):
                return self._stack(hidden_states, args, kwargs, local)
            return strategy.skipped(self, hidden_states, args, kwargs)
        if local.backbone_rows is not None:
            return self._split(hidden_states, args, kwargs, local)
        if strategy.masks_attention:
            kwargs = strategy.before_layer(self, hidden_states, kwargs)
        out = self.backbone(hidden_states, *args, **kwargs)
        router.after_backbone(self.river_layer_idx, hidden_states, out[0] if isinstance(out, tuple) else out)
        return out

    def _stack(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict, local):
        """River's exit layers from this one to the last, as one call when the fused exit layer can
        run them together (``river_stack``: it returns ``(output, layers run)``; the decoder loop
        still calls the later RiverLayers, which then hand their input on). A hook on this exit
        layer, or on a later RiverLayer or exit layer (an output capture), sees each layer's own
        call: then layer by layer."""
        exit_layer = self.exit_layer
        later = list(self.router.layers._modules.values())[self.river_layer_idx + 1:]  # the live decoder list
        if (not later or exit_layer._forward_hooks or exit_layer._forward_pre_hooks
                or any(type(m) is not RiverLayer or m._forward_hooks or m._forward_pre_hooks for m in later)):
            return exit_layer(hidden_states, *args, **kwargs)
        # the exit layers' own hooks are the fused layer's to check (river.exit_stack.StackPlan.runs)
        following = tuple(layer._modules[self._EXIT] for layer in later)
        out, ran = exit_layer(hidden_states, *args, river_stack=following, **kwargs)
        local.stacked = self.river_layer_idx + ran
        return out

    def _split(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict, local):
        """The layer on a batch whose rows disagree: the backbone on the rows still on it, the
        strategy on the rows that left, each on its rows of the arguments and of the KV-cache slot
        (:mod:`.rows`); the outputs are scattered back into one ``[batch, tokens, hidden]``. (A
        tuple output keeps the backbone rows' other entries.)"""
        batch = hidden_states.shape[0]
        written: dict = {}
        outputs = []
        for rows, run in ((local.backbone_rows, self.backbone), (local.exit_rows, None)):
            rows = rows.to(hidden_states.device)
            h = hidden_states.index_select(0, rows)
            a, kw = take_rows(args, rows, batch), rows_kwargs(kwargs, rows, batch, written)
            out = run(h, *a, **kw) if run is not None else local.pass_strategy.skipped(self, h, a, kw)
            outputs.append((rows, h, out))
        (rows_b, h_b, out_b), (rows_e, _, out_e) = outputs
        first_b = out_b[0] if isinstance(out_b, tuple) else out_b
        first_e = out_e[0] if isinstance(out_e, tuple) else out_e
        merged = first_b.new_empty((batch, *first_b.shape[1:]))
        merged.index_copy_(0, rows_b, first_b).index_copy_(0, rows_e, first_e.to(first_b.dtype))
        self.router.after_backbone(self.river_layer_idx, h_b, first_b, rows=rows_b)
        return (merged, *out_b[1:]) if isinstance(out_b, tuple) else merged



class RiverHead(ReadsThroughToBackbone):
    """The LM head, routed: the original head (``backbone``) for a pass that stayed on the backbone,
    the quantized ``exit_head`` for a pass that left it (or when ``exit_head`` is None, the original
    head always). Called like the head: ``[batch, tokens, hidden]`` -> ``[batch, tokens, vocab]``.

    The original head is kept as is (a head tied to the input embeddings stays tied); attributes
    such as ``weight`` are looked up on it.
    """

    _EXIT = "exit_head"

    def __init__(self, backbone: nn.Module, exit_head: nn.Module | None, router: RiverRouter):
        super().__init__()
        self.backbone = backbone
        self.exit_head = exit_head
        self.router = router

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.exit_head is None:
            return self.backbone(hidden_states)
        local = self.router._local
        if local.exited:
            return self.exit_head(hidden_states)
        if local.exit_rows is None or hidden_states.shape[0] != len(local.row_exits):
            return self.backbone(hidden_states)
        # rows that left the backbone read the exit head, the others the original head
        rows_e = local.exit_rows.to(hidden_states.device)
        rows_b = local.backbone_rows.to(hidden_states.device)
        out_b = self.backbone(hidden_states.index_select(0, rows_b))
        out_e = self.exit_head(hidden_states.index_select(0, rows_e))
        logits = out_b.new_empty((hidden_states.shape[0], *out_b.shape[1:]))
        return logits.index_copy_(0, rows_b, out_b).index_copy_(0, rows_e, out_e.to(out_b.dtype))
