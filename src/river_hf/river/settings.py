"""The settings methods of a River model: τ, mode and exit strategy, for the model from now on
(``set_river_tau``, ``set_river_strategy``) or for this thread within a block (``river_mode``,
``river_strategy``, ``river_tau_override``).

:class:`RiverSettingsMixin` is a base of :class:`~river_hf.river.modeling.RiverForCausalLM`; its
methods read the model's ``river`` router and ``river_config`` that ``enable_river`` sets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

from .build import warn_negative_taus
from .config import check_tau
from .layer import MODES
from .strategies import get_strategy

__all__ = ["RiverSettingsMixin"]


class _BlockOnly:
    """What :meth:`RiverSettingsMixin.river_mode` and ``river_strategy`` return: the context manager
    itself, plus a ``RuntimeWarning`` when it is dropped without ever being entered (a bare
    ``model.river_mode("lossless")`` changes nothing, and said nothing)."""

    __slots__ = ("_cm", "_model", "_call", "_entered")

    def __init__(self, cm, model, call: str):
        self._cm, self._model, self._call, self._entered = cm, model, call, False

    def __enter__(self):
        self._entered = True
        self._cm.__enter__()
        return self._model

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<model.{self._call}: a context manager; it acts only in `with model.{self._call}: ...`>"

    def __del__(self):
        if not self._entered:
            warnings.warn(f"model.{self._call} acts only inside a `with` block (with model.{self._call}: ...); "
                          "called alone it changed nothing", RuntimeWarning, stacklevel=2)


class RiverSettingsMixin:
    """τ, mode and strategy of a River model (see the module docstring)."""

    def set_river_tau(self, tau: float) -> None:
        """Change τ from now on, without rebuilding exit layers.

        Every :class:`StateTransitionSimilarityRule` of the rules in force gets threshold ``tau``;
        every other rule (a :class:`MinLayerRule`, custom rules) is kept as it is.
        ``river_config.tau`` (and ``river_config.rules``, when set) follow. For one call only,
        pass ``generate(..., river_tau=tau)`` instead.

        Raises:
            RiverError: ``tau`` is not a number; the rules in force hold no
                :class:`StateTransitionSimilarityRule` (τ would mean nothing).
        """
        tau = check_tau(tau)
        rules = self.river.rules.with_tau(tau)
        warn_negative_taus(rules, stacklevel=2)
        self.river.rules = rules
        rc = self.river_config
        self.river_config = dataclasses.replace(rc, tau=tau, rules=None if rc.rules is None else rules.to_list())

    def river_mode(self, mode: str):
        """Within the block, this thread's calls run in ``mode``:

        - ``"route"``: River (lossy: the exit rule decides per step);
        - ``"lossless"``: the exit path drafts and the backbone verifies in one shared KV cache
          (:mod:`river_hf.river.lossless`): the unmodified model's tokens, faster; ``generate``
          with one sequence, or a batch through River's own loop (:mod:`river_hf.river.lossless_batch`;
          beam search, ``num_return_sequences`` > 1 or a batch with a setting that reads the token
          history runs on the backbone alone: exact, not faster); a plain forward runs the backbone;
        - ``"backbone"``: the unmodified model;
        - ``"exit"``: the fully quantized model (every layer its exit copy), for comparisons.

        Other threads keep their mode (per-call state). ``RiverConfig.lossless`` makes
        ``"lossless"`` the model's own mode.

        Returns a context manager whose ``with ... as m`` gives the model; dropped without being
        entered it warns (``RuntimeWarning``), since it then changed nothing.

        Raises:
            ValueError: an unknown mode (at the call).
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        return _BlockOnly(self.river.override(mode=mode), self, f"river_mode({mode!r})")

    def set_river_strategy(self, strategy: str) -> None:
        """From now on, the layers after an exit do what ``strategy`` says (River's exit layers, or
        one of the baselines of :mod:`river_hf.river.strategies`); ``river_config.strategy``
        follows. For a block of calls in this thread only, use :meth:`river_strategy`.

        Raises:
            RiverError: an unknown strategy; a baseline while lossless mode is the model's own
                (lossless drafting needs River's exit layers).
        """
        name = get_strategy(strategy).name
        self.river_config = dataclasses.replace(self.river_config, strategy=name)  # validates
        self.river.strategy = name

    def river_strategy(self, strategy: str):
        """Within the block, this thread's calls use ``strategy`` for the layers after an exit
        (``"river"``: the exit layers; ``"recompute"``, ``"skipdecode"``, ``"state-propagation"``,
        ``"kv-mask"``: the baselines of :mod:`river_hf.river.strategies`); the exit rule, τ and the
        head stay the same. Other threads keep theirs.

        Returns a context manager as :meth:`river_mode` does (a ``RuntimeWarning`` when dropped
        without being entered).

        Raises:
            RiverError: an unknown strategy (at the call).
        """
        return _BlockOnly(self.river.override(strategy=get_strategy(strategy)), self, f"river_strategy({strategy!r})")

    @contextlib.contextmanager
    def river_tau_override(self, tau: float | None, stacklevel: int = 1):
        """Within the block the rules in force use threshold ``tau`` (as :meth:`set_river_tau`
        does); afterwards the model's own rules and ``river_config`` are as before. ``None``: no
        change. ``stacklevel``: where a negative-τ warning points (1: the ``with`` line).
        Raises as :meth:`set_river_tau`."""
        if tau is None:
            yield self
            return
        rules = self.river.rules.with_tau(check_tau(tau))
        warn_negative_taus(rules, stacklevel=2 + stacklevel)  # past this generator and contextlib's __enter__
        with self.river.override(rules=rules):
            yield self
