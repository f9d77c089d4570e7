"""The one seam to transformers' internals (``river_hf.compat``): no private transformers name is
used anywhere else in the package, and every one used there is listed with its reason.

Static (``ast``, nothing imported but transformers' own source read): the private names of
transformers are the ``_name``\\ s its source defines (functions, methods, classes, assigned
attributes and module-level names) in the modules River touches (its top level, ``generation``,
``cli``, ``integrations``, ``utils`` and the Auto, Llama, Qwen2, Mistral and Gemma3 models). A
use in river-hf is an attribute access, a ``def`` (an override), an import or a string constant
(``getattr(x, "_name")``) of such a name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import transformers

from river_hf import compat

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "river_hf"
SEAM = PACKAGE / "compat.py"
MODEL_FAMILIES = ("auto", "llama", "qwen2", "mistral", "gemma3")

#: Private names of river-hf's own (or of torch / accelerate) that transformers happens to define
#: too: uses of these are not uses of transformers. Each with what it is in river-hf.
NOT_TRANSFORMERS = {
    "_attend": "diffusion/cache.py: the dLLM-Cache adapter's own attention step",
    "_int": "quant/external.py: a local helper",
    "_key": "pareto.py, quant/autotune.py: local helpers",
    "_log": "models.py: the progress printer",
    "_mode": "river/layer.py: the router's per-thread mode",
    "_prompt_ids": "river/modeling.py: a local helper",
    "_save": "quant/autotune.py: the tuner's cache writer",
    "_tokens": "river/layer.py: the router's per-pass token count",
    "_modules": "torch.nn.Module's submodule dict (torch, not transformers)",
    "_version": "torch.Tensor's version counter (torch, not transformers)",
    "_old_forward": "accelerate's hook attribute (accelerate, not transformers)",
    "_metadata": "a torch state dict's module-version metadata (torch.nn.Module.state_dict, not transformers)",
    "_init_weights": "diffusion/modeling.py's test models: the weight-init hook transformers documents for custom "
                     "models (the 'custom models' guide), part of writing a PreTrainedModel",
}


def _private_names_of_transformers() -> set[str]:
    root = Path(transformers.__file__).resolve().parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if parts[0] == "models" and (len(parts) < 3 or parts[1] not in MODEL_FAMILIES):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def _uses(path: Path, private: set[str]) -> list[tuple[str, int]]:
    """``(name, line)`` of every use of a transformers private name in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # the module's own attributes: what it assigns to self._x, and the methods it calls itself (self._x(...)
    # of a def in this module); a def nobody here calls is a hook for someone else: an override
    assigned = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", None) == "self"}
    called = {n.attr for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and getattr(n.value, "id", None) == "self"}
    methods = {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own = assigned | (methods & called)
    in_class = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}  # module-level defs override nothing
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            names = [a.name for a in node.names]
            names += [p for p in node.module.split(".") if p.startswith("_")]
        elif isinstance(node, ast.Attribute):
            names = [] if getattr(node.value, "id", None) == "self" and node.attr in own else [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [] if node.name in own or id(node) not in in_class else [node.name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names = [] if node.value in own else [node.value]  # self.__dict__["_x"] of the module's own _x
        else:
            continue
        found += [(n, node.lineno) for n in names
                  if n[:1] == "_" and n[1:2].isalpha() and (n in private or isinstance(node, ast.ImportFrom))]
    return found


@pytest.fixture(scope="module")
def private() -> set[str]:
    return _private_names_of_transformers()


def test_no_private_transformers_name_outside_the_seam(private):
    violations = [f"{path.relative_to(PACKAGE)}:{line} {name}" for path in sorted(PACKAGE.rglob("*.py"))
                  if path != SEAM for name, line in _uses(path, private) if name not in NOT_TRANSFORMERS]
    assert violations == [], (
        "private transformers names outside river_hf/compat.py: move each into the seam with a line in "
        "compat.PRIVATE_NAMES saying why no public way does the job")


def test_the_check_fails_on_a_new_private_name(private, tmp_path):
    """The check above is not vacuous: a module that reaches into generate's internals fails it."""
    source = ("def f(model, cfg):\n"
              "    model._prepare_special_tokens(cfg)\n"
              "    return getattr(cfg, '_eos_token_tensor', None)\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert [name for name, _ in _uses(path, private)] == ["_prepare_special_tokens", "_eos_token_tensor"]


def test_every_private_name_in_the_seam_is_listed_with_its_reason(private):
    used = {name for name, _ in _uses(SEAM, private)}
    assert used, "the seam uses no private name: the scan found nothing, so it is broken"
    assert used <= set(compat.PRIVATE_NAMES), sorted(used - set(compat.PRIVATE_NAMES))
    assert set(compat.PRIVATE_NAMES) <= used, ("listed but not used any more: "
                                               f"{sorted(set(compat.PRIVATE_NAMES) - used)}")
    assert all(isinstance(why, str) and len(why) > 20 for why in compat.PRIVATE_NAMES.values())


def test_each_private_name_still_exists_in_this_transformers(private):
    """A transformers release that drops one of them fails here by name, not deep inside generate."""
    missing = sorted(set(compat.PRIVATE_NAMES) - private)
    assert missing == [], f"transformers {transformers.__version__} no longer defines {missing}: adapt river_hf/compat.py"


def test_exit_copies_run_the_architectures_code_when_the_backbone_was_kernelized():
    """transformers >= 5.25 ``kernelize``s models in ``from_pretrained`` (the ``kernels`` library sets
    a per-instance ``forward`` and ``_kernel_repo`` on each layer it swaps for a Hub kernel; on this
    CPU none is swapped, so the swap is simulated here the way ``kernels`` does it). The backbone keeps
    its kernel (τ > 1 is the plain model's path); the exit copies, whose Linears are River's own
    quantized modules, run the architecture's torch code."""
    import types

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from river_hf import enable_river

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    calls = []

    def hub_kernel_forward(self, hidden_states):  # a stand-in Hub kernel: the same math, counted
        calls.append(self)
        return type(self).forward(self, hidden_states)

    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.mlp):
            norm.forward = types.MethodType(hub_kernel_forward, norm)
            norm.__dict__["_kernel_repo"] = "kernels-community/stand-in"
    enable_river(model, tau=2.0, backend="int8", tuner=False, progress=False)
    for layer in model.model.layers:
        assert "forward" in layer.backbone.input_layernorm.__dict__ and "forward" in layer.backbone.mlp.__dict__
        assert not any("forward" in m.__dict__ for m in layer.exit_layer.modules())
    x = torch.tensor([[1, 2, 3, 4]])
    model.generate(x, max_new_tokens=2, do_sample=False)
    assert calls and all(any(m is layer.backbone.input_layernorm or m is layer.backbone.mlp
                             for layer in model.model.layers) for m in calls)


@pytest.mark.parametrize("impl", [None, "eager", "sdpa"])
def test_the_attention_implementation_read_is_the_configs_own(impl):
    """``attn_implementation`` reads the instance dict's ``_attn_implementation_internal``: the same
    value as the config's ``_attn_implementation`` property (the default where it is unset), and the
    property for an object whose dict lacks it."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1)
    if impl is not None:
        config._attn_implementation = impl
    assert compat.attn_implementation(config) == (config._attn_implementation or "sdpa")
    assert compat.attn_implementation(SimpleNamespace(_attn_implementation="eager")) == "eager"
    assert compat.attn_implementation(SimpleNamespace(), default="x") == "x"
