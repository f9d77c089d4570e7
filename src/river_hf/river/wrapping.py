"""The wrapper that speaks its backbone's names: :class:`ReadsThroughToBackbone`, the base of
:class:`~river_hf.river.layer.RiverLayer` and :class:`~river_hf.river.layer.RiverHead`, with its
state-dict hooks, and :func:`exit_modules`.

A River model wraps each decoder layer (and the LM head) around the original module
(``backbone``) and a derived quantized copy (the exit copy). This module makes the wrapper
invisible to the model's names: ``state_dict``, ``load_state_dict`` and ``named_modules`` give and
take the architecture's own keys, so a River model saves, loads and is matched by PEFT like the
plain model; the exit copies stay reachable as attributes (:func:`exit_modules`).
"""

from __future__ import annotations

from torch import nn

__all__ = ["ReadsThroughToBackbone", "exit_modules"]


class ReadsThroughToBackbone(nn.Module):
    """A wrapper that speaks its backbone's names.

    Attributes the wrapper does not have are looked up on its ``backbone`` (the model's own code
    reads ``attention_type``, ``layer_idx``, ``weight`` ... from its layers and head).

    The exit copy (the attribute named by ``_EXIT``) is derived state, a quantized copy rebuilt
    from the backbone, so the wrapper is invisible to the model's names:

    * ``state_dict()`` holds the backbone's entries under the wrapper's own name
      (``layers.3.self_attn.q_proj.weight``, not ``layers.3.backbone.self_attn.q_proj.weight``)
      and nothing of the exit copy: the architecture's own keys;
    * ``load_state_dict`` takes those keys (and the wrapped ``backbone.`` ones) into the backbone,
      drops entries of the exit copy and does not count the exit copy's tensors as missing;
    * ``named_modules()`` (and so ``named_parameters()``, ``modules()``, ``parameters()``,
      ``buffers()`` and PEFT's target matching) gives the backbone's modules under the same
      names and does not enter the exit copy; ``children()`` does (``to()``, ``eval()`` and
      ``apply()`` reach it). The copy itself stays reachable as the attribute
      (:func:`exit_modules` lists the copies' modules).
    """

    _EXIT = ""  # attribute holding the derived exit copy

    def __init__(self):
        super().__init__()
        _hook(self, "register_state_dict_post_hook", "_register_state_dict_hook")(_state_dict_in_backbone_names)
        _hook(self, "register_load_state_dict_pre_hook", None)(_load_into_backbone)
        self.register_load_state_dict_post_hook(_exit_copy_not_missing)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("backbone", "exit_layer", "exit_head") or "backbone" not in self._modules:
                raise
            return getattr(self._modules["backbone"], name)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        """As ``nn.Module.named_modules``, in the architecture's names: the wrapper, then its
        backbone under the same name and the backbone's submodules under the names they have in
        the plain model (``layers.3.self_attn.q_proj``, which ``get_submodule`` resolves through
        the wrapper); the exit copy's subtree is left out."""
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        for name, module in self._modules.items():
            if module is None or name == self._EXIT:
                continue
            yield from module.named_modules(memo, prefix if name == "backbone" else prefix + ("." if prefix else "") + name,
                                            remove_duplicate)


def _hook(module: nn.Module, public: str, older: str | None):
    """``module``'s hook registration method ``public`` (torch >= 2.5 for the state-dict post-hook),
    else its older name (same hook signature)."""
    method = getattr(module, public, None)
    if method is not None:
        return method
    if older is not None:
        return getattr(module, older)
    return lambda hook: module._register_load_state_dict_pre_hook(hook, with_module=True)


def _state_dict_in_backbone_names(module, state_dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: ``prefix + "backbone." + k`` -> ``prefix + k``; exit-copy entries
    dropped. Entries keep their order."""
    inner, derived = prefix + "backbone.", prefix + module._EXIT + "."
    moved = [(k, state_dict.pop(k)) for k in [k for k in state_dict if k.startswith(prefix)]]
    for k, v in moved:
        if k.startswith(inner):
            state_dict[prefix + k[len(inner):]] = v
        elif not k.startswith(derived):
            state_dict[k] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:  # module versions, keyed by module name
        for k in [k for k in meta if k.startswith(prefix)]:
            if k == inner[:-1] or k.startswith(inner):
                meta[(prefix + k[len(inner):]).rstrip(".")] = meta.pop(k)
            elif k == derived[:-1] or k.startswith(derived):
                del meta[k]


def _load_into_backbone(module, state_dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    """Load-state-dict pre-hook: the architecture's keys (``prefix + k``) go to the backbone
    (``prefix + "backbone." + k``); exit-copy entries are dropped (the copy is rebuilt from the
    backbone). Changes the dict load_state_dict hands this module's children, not the caller's."""
    inner, derived = prefix + "backbone.", prefix + module._EXIT + "."
    for k in [k for k in state_dict if k.startswith(prefix)]:
        if k.startswith(derived):
            del state_dict[k]
        elif not k.startswith(inner):
            state_dict[inner + k[len(prefix):]] = state_dict.pop(k)
    module.__dict__["_river_load_prefix"] = prefix


def _exit_copy_not_missing(module, incompatible_keys) -> None:
    """Load-state-dict post-hook: the exit copy's tensors are not missing keys (derived state)."""
    prefix = module.__dict__.pop("_river_load_prefix", None)
    if prefix is not None:
        derived = prefix + module._EXIT + "."
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not k.startswith(derived)]


def exit_modules(model: nn.Module):
    """Yield ``(name, module)`` for every module of ``model``'s exit copies (the exit layers and
    the exit head, and their submodules), named as attributes reach them
    (``model.layers.0.exit_layer.self_attn.q_proj``): what ``model.named_modules()`` leaves out."""
    for name, module in model.named_modules():
        exit_copy = getattr(module, module._EXIT, None) if isinstance(module, ReadsThroughToBackbone) else None
        if exit_copy is not None:
            yield from exit_copy.named_modules(prefix=f"{name}.{module._EXIT}" if name else module._EXIT)
