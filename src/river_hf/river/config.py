"""River settings: :class:`RiverConfig`, the per-model defaults of ``configs/``, and τ checks.

Imports nothing of the rest of :mod:`river_hf.river` but the rule and routing names, so
:mod:`.serialization`, :mod:`.offload` and :mod:`.modeling` can all read settings without
importing each other.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

from ..errors import RiverError
from ..files import atomic_write, gguf_file_problem
from ..models import REGISTRY
from ..quant import get_backend
from .controllers import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule, rules_from_config
from .draft_schedule import SCHEDULES
from .layer import PREFILL_POLICIES
from .strategies import STRATEGIES

#: lossless-mode choices (defined here, at the bottom of the import graph; :mod:`.lossless` reuses them)
DRAFT_SCHEDULES = tuple(SCHEDULES)  # the built-in ones; validation reads the live registry (:mod:`.draft_schedule`)
VERIFY_KERNELS = ("auto", "onednn", "river-fp32", "torch")  # also the values of backbone_kernel
#: where a lossless draft pass runs: ``route`` (River's exit path: backbone layers until the draft
#: rules say exit, then exit layers) or ``exit`` (every layer its exit copy: no backbone layer)
DRAFT_PATHS = ("route", "exit")
#: when a round proposes prompt-lookup tokens (given a match): ``always``, or ``adaptive`` (only
#: while their measured tokens per second in this call beat the exit-path drafts')
PROMPT_LOOKUP_RULES = ("always", "adaptive")
#: what an exit layer runs (``RiverConfig.exit_layer_impl``): the architecture's own decoder-layer
#: code over the quantized Linears, River's fused layer of the family (:mod:`.fused_layer`) where
#: one supports the layer (``fused`` warns where none does, ``auto`` does not)
EXIT_LAYER_IMPLS = ("architecture", "fused", "auto")

__all__ = ["RiverConfig", "default_config", "check_tau", "warn_if_negative_tau", "CONFIG_DIR", "RIVER_SETTINGS",
           "river_settings", "EXIT_LAYER_IMPLS"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def check_tau(tau) -> float:
    """``tau`` as a float.

    Raises:
        RiverError: ``tau`` is not a number, or is NaN.
    """
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise RiverError(f"tau must be a number (e.g. 0.95; above 1 never exits), got {tau!r}") from None
    if math.isnan(value):
        raise RiverError("tau must be a number (e.g. 0.95; above 1 never exits), got NaN")
    return value


#: The River settings ``RiverForCausalLM.from_pretrained``, ``from_config`` and ``enable_river`` take as
#: keyword arguments, each overriding the :class:`RiverConfig` field of that name.
RIVER_SETTINGS = ("tau", "min_layer", "backend", "exit_head", "prefill", "lossless", "strategy", "prompt_kernel",
                  "exit_layer_impl", "backbone_kernel", "backbone_grid", "offload_from", "offload_dir")


def river_settings(kwargs: dict, *, allowed: tuple = RIVER_SETTINGS, where: str = "enable_river") -> dict:
    """Take River's settings out of ``kwargs`` (in place) and return them: the one checked path
    of ``from_pretrained``, ``from_config`` and ``enable_river``. A setting given as None counts as
    not given, except ``exit_head=None`` (no exit head). Values are checked later, by
    :class:`RiverConfig`.

    Raises:
        RiverError: a River setting ``where`` does not take (``offload_from`` / ``offload_dir``
            outside ``from_pretrained``).
    """
    settings = {}
    for name in RIVER_SETTINGS:
        if name in kwargs:
            value = kwargs.pop(name)
            if name not in allowed:
                raise RiverError(f"{where} does not take {name}= (only RiverForCausalLM.from_pretrained does: the "
                                 "backbone must be loaded offloaded)")
            if value is not None or name == "exit_head":
                settings[name] = value
    return settings


def warn_if_negative_tau(tau: float, min_layer: int | None = None, stacklevel: int = 2) -> None:
    """Warn (``UserWarning``, once per call) that a negative τ makes (nearly) every forward pass
    leave the backbone right after ``min_layer`` backbone layers. Legal: the tests use τ = -2 to
    force an exit at every step. ``stacklevel`` as for ``warnings.warn``."""
    if tau < 0:
        after = f"min_layer={min_layer}" if min_layer is not None else "min_layer"
        warnings.warn(
            f"tau={tau:g} is negative: the state transition similarity is a cosine in [-1, 1], so "
            f"{'every' if tau < -1 else 'nearly every'} forward pass will leave the backbone after {after} "
            "backbone layers (pick tau in (0, 1) for real early exit, above 1 for the unmodified model)",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


@dataclasses.dataclass
class RiverConfig:
    """River settings; round-trips through ``to_dict``/``from_dict`` (and so through config.json).

    About the offline checkpoints: the models of river-hf's offline registry
    (:data:`river_hf.models.REGISTRY`: ``smollm2-135m``, ``qwen2.5-coder-*``, ``gemma-3-270m``)
    are GGUF files (Q4_K_M, Q4_1 for SmolLM2) dequantized to fp32, not the Hub's original
    weights. Their "unmodified" model therefore already sits on a 4-bit grid, and River's exit
    layers re-quantize those dequantized weights (a second rounding, onto the exit kernel's grid).

    Attributes:
        tau: state-transition-similarity threshold τ (River-LLM Sec. 3.2); the rest of the layers
            run as exit layers once a backbone layer's similarity exceeds it. ``tau > 1`` never
            exits (exactness); ``tau < 0`` is legal (exits at nearly every step; it warns).
        min_layer: backbone layers that always run before an exit is considered (>= 1, below the
            model's number of layers; checked by ``enable_river``).
        backend: kernel choice of the exit layers' Linears (:func:`river_hf.quant.get_backend`):
            ``int8`` / ``int4`` (fastest kernel of that width per shape, measured on this machine),
            or one kernel (``torch-int8``, ``torch-int4``, ``quanto-int4`` = ``quanto``,
            ``quanto-int8``, ``copy``).
        exit_head: kernel choice of the *exit head*, a quantized copy of the LM head that serves
            every step whose forward pass left the backbone (same names as ``backend``); None: the
            original head serves every step. The backbone path always keeps the original head.
        prefill: ``route`` (the prompt pass takes River's sequence-level exit decision) or
            ``backbone`` (the prompt runs on the backbone: exact KV for the prompt; only decode
            steps exit).
        rules: explicit exit-rule list (``ExitRuleList.to_list()``); when set it replaces the
            rules built from ``tau`` and ``min_layer``.
        strategy: what the layers after an exit do (:mod:`river_hf.river.strategies`): ``river``
            (their exit layers, KV share), or one of the baselines River-LLM compares with, which
            read the token out at the exit (no exit layers) and differ in the skipped layers' K/V:
            ``recompute`` (EE-LLM), ``skipdecode`` (SkipDecode), ``state-propagation`` (CALM),
            ``kv-mask`` (D-LLM). Lossless mode needs ``river``.
        lossless: run ``generate`` in lossless mode by default (the exit path drafts, the backbone
            verifies: the unmodified model's tokens; :mod:`river_hf.river.lossless`); a saved
            River folder and its pipeline then default to it. ``model.river_mode(...)`` overrides it.
        draft_tokens: lossless mode: drafts of the first round that drafts (after the prefill), k (>= 1).
        max_draft_tokens: lossless mode: the most drafts one round may propose (>= ``draft_tokens``),
            however many rounds in a row were fully accepted, so a verify pass never runs more than
            ``max_draft_tokens + 1`` rows (the rows the prepacked verify kernel is used for); a
            batch of B rows verifies up to B times that. The
            default 15 (16 verify rows) follows ``benchmarks/verify_linear.py``: at 16 rows a prepacked
            896x4864 product reads its weights at half the one-row rate, so longer rounds cost more
            per token than they save in drafts (docs/results/verify_linear.txt).
        draft_schedule: lossless mode, how k changes from round to round (:mod:`.draft_schedule`):
            ``heuristic`` (k + 2 after a fully accepted round, k - 1 otherwise, as transformers'
            ``num_assistant_tokens_schedule="heuristic"``), ``constant``, ``cost`` (the k with the
            most expected tokens per unit of cost, Leviathan et al. 2023, §3.5: the call's accepted
            runs by Kaplan-Meier, the draft passes' weight bytes over a backbone pass's, and the
            verify priced by its rows as measured on this machine) or ``cost-flat`` (every verify
            priced as one pass, as in the paper).
        prompt_lookup_tokens: lossless mode: when > 0, a round whose last tokens occurred earlier
            in the sequence proposes the up to this many tokens that followed them (prompt lookup
            decoding, no draft pass) instead of drafting through the exit path; 0: off.
        prompt_lookup_rule: lossless mode, with ``prompt_lookup_tokens`` > 0: ``always`` (every round
            with a match) or ``adaptive`` (a match is used while prompt-lookup rounds have produced
            at least as many tokens per second of round time in this call as exit-path rounds, and
            is retried every few rounds otherwise: :class:`river_hf.river.lossless.LookupGate`).
        draft_path: lossless mode: where a draft pass runs (:data:`DRAFT_PATHS`): ``route`` (River's
            exit path with ``draft_tau`` / ``draft_min_layer``) or ``exit`` (every layer its exit
            copy, no backbone layer: a fully low-precision draft, as QSpec's).
        draft_tau, draft_min_layer: lossless mode, ``draft_path="route"``: τ and min layer of the
            draft passes' exit rule (None: ``tau`` / ``min_layer``, the lossy mode's).
        draft_vocab: lossless mode: when > 0, draft passes score only this many token ids, the most
            frequent ones in text that is not evaluation data (FR-Spec, Zhao et al. 2025,
            arXiv 2502.14856; :mod:`river_hf.river.draft_vocab`), through a quantized copy of those
            rows of the LM head; the verify keeps the full head, so the output is unchanged.
            0: the whole vocabulary (the exit head).
        verify_kernel: lossless mode, fp32 CPU: ``auto`` (the fastest measured of ``F.linear``,
            oneDNN on prepacked weights and river-fp32 for the multi-token verify passes and for
            one-row calls; oneDNN also for the prompt pass where it measured faster at a prompt's
            row count; oneDNN costs a packed copy of the backbone's Linear weights, river-fp32
            nothing), ``onednn`` (unmeasured), ``river-fp32`` (unmeasured, up to 16 rows) or ``torch``.
        backbone_kernel: route mode, fp32 CPU: the kernel of the backbone layers River runs (and
            of the original LM head): ``auto`` (the kernel ``verify_kernel`` chose for one-row
            calls, where it measured faster than ``F.linear``), ``onednn`` or ``river-fp32``
            (unmeasured) or ``torch``; never while the rules cannot exit (τ > 1 stays the plain
            model). See :func:`river_hf.river.verify_kernel.backbone_mode`.
        backbone_grid: fp32 CPU, a model converted from a GGUF file: read the backbone's products (route
            mode's backbone layers, lossless verify passes, up to the rows where it measured faster)
            from the GGUF's own grid, about 1.25 bytes a weight instead of 4, with the same weights
            bit for bit (each grid is checked against its weight; :mod:`river_hf.quant.grid`):
            ``auto`` (the registry models' own GGUF, where ``river-hf`` keeps it), ``off``, or the
            GGUF file's path. Never while the rules cannot exit (τ > 1), as ``backbone_kernel``.
        offload_from: first backbone layer kept off the compute device (None: no offload).
        offload_dir: folder for disk offload on CPU-only machines (None: a temporary folder).
        kernel_choice: the kernel each Linear shape of a measured choice (``int4`` / ``int8``) got,
            ``{"<choice>:<in>x<out>[+bias]": kernel name}`` (e.g. ``{"int4:896x4864": "torch-int4"}``,
            :func:`river_hf.quant.shape_key`). ``enable_river`` fills it with what it built, so a
            saved River folder records it; a build given it reuses each kernel that exists on the
            machine instead of measuring (and warns once, naming the shapes, where one does not).
            None: every measured shape is measured (or taken from ``kernels.json``). A shape whose
            timings were invalid (a busy machine; :mod:`river_hf.quant.prior`) also has a
            ``"<key>#prior"`` entry saying why the prior ranking chose it; a build on a quiet
            machine measures those shapes again.
        fuse_projections: each exit layer runs its q/k/v projections as one stacked product and its
            gate/up projections as one (:mod:`river_hf.quant.fused`; 4 weight products per layer
            instead of 7, split after; the KV share is unchanged); the stacked shapes get their
            own kernel choice (e.g. ``int4:896x1152+bias``). Layers without those names are not
            fused. The backbone is never fused. Off by default: on a loaded 2-core machine it
            did not measure faster end to end (``benchmarks/step_profile.py --fusion``,
            docs/results/archive/profile-measurements.md); the stacked q/k/v alone was faster.
        prompt_kernel: with a measured ``backend`` (``int4``/``int8``), each exit Linear also gets a
            prompt kernel (onnxruntime ``MatMulNBits``, int8 dot products) where that measures faster
            than the one-row kernel at 128 rows: calls of 16 rows or more through the exit layers
            (the prompt of the fully quantized model, River's prefill after its exit, a decode step
            of 16+ sequences) run on it (:class:`river_hf.quant.modules.PromptRowsLinear`); the
            choice is recorded in ``kernel_choice`` (keys ending ``@128rows``). Costs a second copy of those
            weights (about the exit layers' size again: +189 MB on Qwen2.5-Coder-0.5B; not built,
            with a warning, when it could take over half the memory available, lossless mode's
            rule for its packed copy). Needs
            onnxruntime and a tuner; decode steps are unchanged. Off by default: the fully quantized
            prompt pass measured 1.11-1.30x faster on held-out prompts of 152-332 tokens (2-core
            Zen 5, ``benchmarks/prompt_kernel.py``), River's defaults read the prompt on the
            backbone (``prefill="backbone"``) and would hold the copy for nothing.
        exit_layer_impl: what each exit layer runs (:data:`EXIT_LAYER_IMPLS`): ``architecture`` (the
            architecture's decoder-layer class over the quantized Linears), ``fused`` (River's own
            fused layer of the architecture's family, :mod:`river_hf.river.fused_layer`, on the same
            kernel modules: fewer, bigger calls per layer and step; a warning where no family supports
            the layers) or ``auto`` (fused where a family supports the layer, silently). Each fused
            layer is checked against the architecture's exit copy at build and keeps that copy, with
            a warning, where their updates differ by more than 1e-3 relative (fp32 models; 16-bit
            models: 4 units of their rounding, ``fused_layer.check_tolerance``). Families:
            Llama, Qwen2, Mistral (``sdpa`` or ``eager`` attention). The backbone always runs the
            architecture's code. Pair it with ``fuse_projections`` for one q/k/v and one gate/up
            product per layer.

    Raises (at construction):
        RiverError: τ not a number, ``min_layer`` < 1, unknown backend, prefill policy, strategy,
            draft schedule, verify kernel or exit-layer implementation, lossless with a baseline strategy, ``draft_tokens`` < 1, ``max_draft_tokens`` < ``draft_tokens``, bad ``offload_from``, rules or ``kernel_choice``.
    """

    tau: float = 0.95
    min_layer: int = 1
    backend: str = "quanto"
    exit_head: str | None = None
    prefill: str = "route"
    rules: list[dict] | None = None
    strategy: str = "river"
    lossless: bool = False
    draft_tokens: int = 4
    max_draft_tokens: int = 15
    draft_schedule: str = "cost"
    prompt_lookup_tokens: int = 0
    prompt_lookup_rule: str = "always"
    draft_path: str = "route"
    draft_tau: float | None = None
    draft_min_layer: int | None = None
    draft_vocab: int = 0
    verify_kernel: str = "auto"
    backbone_kernel: str = "auto"
    backbone_grid: str = "auto"
    offload_from: int | None = None
    offload_dir: str | None = None
    kernel_choice: dict[str, str] | None = None
    fuse_projections: bool = False
    prompt_kernel: bool = False
    exit_layer_impl: str = "architecture"

    def __post_init__(self):
        self.tau = check_tau(self.tau)
        if not isinstance(self.min_layer, int) or self.min_layer < 1:
            raise RiverError(f"min_layer must be an integer >= 1, got {self.min_layer!r}")
        get_backend(self.backend)
        if self.exit_head is not None:
            get_backend(self.exit_head)
        if self.prefill not in PREFILL_POLICIES:
            raise RiverError(f"prefill must be one of {', '.join(PREFILL_POLICIES)}, got {self.prefill!r}")
        if self.strategy not in STRATEGIES:
            raise RiverError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if not isinstance(self.lossless, bool):
            raise RiverError(f"lossless must be true or false, got {self.lossless!r}")
        if self.lossless and self.strategy != "river":
            raise RiverError(f"lossless mode drafts with River's exit layers: it needs strategy 'river', got "
                             f"{self.strategy!r} (set lossless=false to run the baseline)")
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or self.draft_tokens < 1:
            raise RiverError(f"draft_tokens must be an integer >= 1, got {self.draft_tokens!r}")
        if (isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int)
                or self.max_draft_tokens < self.draft_tokens):
            raise RiverError(f"max_draft_tokens must be an integer >= draft_tokens ({self.draft_tokens}), "
                             f"got {self.max_draft_tokens!r}")
        if self.draft_schedule not in SCHEDULES:  # the registry itself: schedules registered later count
            raise RiverError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, got {self.draft_schedule!r}")
        if (isinstance(self.prompt_lookup_tokens, bool) or not isinstance(self.prompt_lookup_tokens, int)
                or self.prompt_lookup_tokens < 0):
            raise RiverError(f"prompt_lookup_tokens must be an integer >= 0 (0: off), got {self.prompt_lookup_tokens!r}")
        if self.prompt_lookup_rule not in PROMPT_LOOKUP_RULES:
            raise RiverError(f"prompt_lookup_rule must be one of {', '.join(PROMPT_LOOKUP_RULES)}, "
                             f"got {self.prompt_lookup_rule!r}")
        if self.draft_path not in DRAFT_PATHS:
            raise RiverError(f"draft_path must be one of {', '.join(DRAFT_PATHS)}, got {self.draft_path!r}")
        if self.draft_tau is not None:
            self.draft_tau = check_tau(self.draft_tau)
        if self.draft_min_layer is not None and (isinstance(self.draft_min_layer, bool)
                                                 or not isinstance(self.draft_min_layer, int) or self.draft_min_layer < 1):
            raise RiverError(f"draft_min_layer must be an integer >= 1 or null, got {self.draft_min_layer!r}")
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
            raise RiverError(f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {self.draft_vocab!r}")
        if self.verify_kernel not in VERIFY_KERNELS:
            raise RiverError(f"verify_kernel must be one of {', '.join(VERIFY_KERNELS)}, got {self.verify_kernel!r}")
        if self.backbone_kernel not in VERIFY_KERNELS:
            raise RiverError(f"backbone_kernel must be one of {', '.join(VERIFY_KERNELS)}, got {self.backbone_kernel!r}")
        if not isinstance(self.backbone_grid, str):
            raise RiverError(f"backbone_grid must be 'auto', 'off' or a GGUF file's path, got {self.backbone_grid!r}")
        problem = gguf_file_problem(self.backbone_grid) if self.backbone_grid not in ("auto", "off") else None
        if problem:
            raise RiverError(f"backbone_grid must be 'auto', 'off' or the path of the GGUF file the model was "
                             f"converted from ({problem}: {self.backbone_grid!r})")
        if self.offload_from is not None and (not isinstance(self.offload_from, int) or self.offload_from < 0):
            raise RiverError(f"offload_from must be a layer index >= 0 or None, got {self.offload_from!r}")
        if self.kernel_choice is not None and not (
                isinstance(self.kernel_choice, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in self.kernel_choice.items())):
            raise RiverError(f"kernel_choice must map shape keys to kernel names (e.g. {{\"int4:896x4864\": "
                             f"\"torch-int4\"}}) or be null, got {self.kernel_choice!r}")
        if self.exit_layer_impl not in EXIT_LAYER_IMPLS:
            raise RiverError(f"exit_layer_impl must be one of {', '.join(EXIT_LAYER_IMPLS)}, got {self.exit_layer_impl!r}")
        for name in ("fuse_projections", "prompt_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise RiverError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.rules is not None:
            try:
                rules_from_config(self.rules)
            except (TypeError, ValueError) as e:
                raise RiverError(f"invalid River exit rules {self.rules!r}: {e}") from None

    def build_rules(self) -> ExitRuleList:
        """The rule list in force: ``rules`` when set, else ``[MinLayerRule(min_layer),
        StateTransitionSimilarityRule(tau)]``."""
        if self.rules is not None:
            return rules_from_config(self.rules)
        return ExitRuleList([MinLayerRule(self.min_layer), StateTransitionSimilarityRule(self.tau)])

    def build_draft_rules(self) -> ExitRuleList | None:
        """The exit rules of lossless draft passes on the ``route`` path: ``[MinLayerRule(draft_min_layer
        or min_layer), StateTransitionSimilarityRule(draft_tau or tau)]`` when either draft setting is
        given; None (the lossy mode's rules) otherwise."""
        if self.draft_tau is None and self.draft_min_layer is None:
            return None
        return ExitRuleList([MinLayerRule(self.draft_min_layer if self.draft_min_layer is not None else self.min_layer),
                             StateTransitionSimilarityRule(self.draft_tau if self.draft_tau is not None else self.tau)])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rules"] = self.build_rules().to_list()
        d["quantization"] = get_backend(self.backend).to_dict()
        if self.exit_head is not None:
            d["exit_head_quantization"] = get_backend(self.exit_head).to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RiverConfig:
        """Raises RiverError for unknown keys or invalid values."""
        if not isinstance(d, dict):
            raise RiverError(f"River settings must be a JSON object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if k not in ("quantization", "exit_head_quantization")}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise RiverError(f"unknown River settings {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)

    def to_file(self, path) -> None:
        """Write these settings as a ``configs/``-style JSON file (the fields; the rule list only when
        ``rules`` is set), via a temporary file renamed into place."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "rules" or v is not None}
        atomic_write(path, json.dumps(d, indent=2) + "\n")

    @classmethod
    def from_file(cls, path) -> RiverConfig:
        """Settings from a ``configs/``-style JSON file (what :meth:`to_file` and ``river-hf
        calibrate --out`` write); load a model with them as
        ``RiverForCausalLM.from_pretrained(name, river_config=RiverConfig.from_file(path))``.

        Raises:
            RiverError: the file is missing or not JSON, or holds unknown keys or invalid values.
        """
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise RiverError(f"River settings file {path}: {type(e).__name__}: {e}") from None
        return cls.from_dict(d)


def default_config(name_or_key: str | None = None, model_type: str | None = None) -> RiverConfig:
    """Per-model defaults from ``configs/<key>.json``, else ``configs/default-<model_type>.json``,
    else ``configs/default.json``, else ``RiverConfig()``.

    ``name_or_key`` may be a model key, its Hub id, or a folder whose name is a key (the cache
    folders made by :func:`river_hf.models.resolve` are).

    Raises:
        RiverError: the chosen ``configs/`` file holds invalid settings.
    """
    candidates = []
    if name_or_key:
        base = Path(str(name_or_key).rstrip("/")).name
        candidates += [name_or_key, base]
        candidates += [e.key for e in REGISTRY.values() if e.hub_id.lower() == str(name_or_key).lower()]
    if model_type:
        candidates.append(f"default-{model_type}")
    candidates.append("default")
    for c in candidates:
        path = CONFIG_DIR / f"{c}.json"
        if path.is_file():
            return RiverConfig.from_dict(json.loads(path.read_text()))
    return RiverConfig()
