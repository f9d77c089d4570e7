"""A River model speaks its architecture's parameter names (issue 36).

``state_dict()`` holds the architecture's keys (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``) and nothing of the exit copies (derived state); ``load_state_dict`` of the
plain model's state dict (strict) loads the backbone and the exit copies follow it; a PEFT LoRA
adapter with default target names wraps backbone Linears only.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

from river_hf import disable_river, enable_river
from river_hf.river import exit_modules

COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=8, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}
GEN = dict(do_sample=False)


def tiny(family: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    model.generation_config.pad_token_id = 0
    return model


def river_of(model, tau: float = 2.0, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a negative tau warns by design
        return enable_river(copy.deepcopy(model), tau=tau, min_layer=kw.pop("min_layer", 1),
                            backend=kw.pop("backend", "int4"), exit_head=kw.pop("exit_head", "int4"),
                            progress=False, **kw)


def perturbed(model, seed: int = 5, scale: float = 0.5):
    """A copy of ``model`` with every parameter moved by scaled Gaussian noise."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return other


def prompt(length: int = 10, seed: int = 1, vocab: int = 256):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_state_dict_has_the_plain_keys_and_tensors_and_no_exit_copy(family):
    plain = tiny(family)
    river = river_of(plain)
    ours, theirs = river.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)  # same keys, same order
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert not any("backbone" in k or "exit_" in k for k in ours)
    # the tensors themselves, as a plain state dict gives them (shared with the backbone)
    backbone_q = river.model.layers[0].backbone.self_attn.q_proj.weight
    assert river.state_dict(keep_vars=True)["model.layers.0.self_attn.q_proj.weight"] is backbone_q
    # named_modules/parameters do not enter the exit copies; exit_modules() does
    assert not any(".exit_layer" in n or ".exit_head" in n for n, _ in river.named_modules())
    assert [n for n, _ in river.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert river.get_parameter("model.layers.0.self_attn.q_proj.weight") is backbone_q
    exit_names = [n for n, _ in exit_modules(river)]
    assert "model.layers.0.exit_layer.self_attn.q_proj" in exit_names and "lm_head.exit_head" in exit_names
    assert set(disable_river(river).state_dict()) == set(theirs)


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_plain_state_dict_of_changed_weights_loads_strictly_and_every_mode_follows(family):
    base = tiny(family)
    river = river_of(base)
    new = perturbed(base)
    ids = prompt()
    ref = new.generate(ids, max_new_tokens=16, **GEN)
    assert not torch.equal(ref, base.generate(ids, max_new_tokens=16, **GEN))  # the change matters
    old_exit = river.model.layers[0].exit_layer
    with river.river_mode("exit"):
        old_exit_tokens = river.generate(ids, max_new_tokens=16, **GEN)
    result = river.load_state_dict(new.state_dict())  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert river.model.layers[0].exit_layer is not old_exit  # rebuilt at load, not only at the next generate
    assert torch.equal(river.generate(ids, max_new_tokens=16, **GEN), ref)  # tau = 2: the backbone only
    with river.river_mode("lossless"):
        assert torch.equal(river.generate(ids, max_new_tokens=16, **GEN), ref)
    # the exit path is the one River builds on the new weights, not the old copies
    fresh = river_of(new)
    with river.river_mode("exit"), fresh.river_mode("exit"):
        out, want = river.generate(ids, max_new_tokens=16, **GEN), fresh.generate(ids, max_new_tokens=16, **GEN)
    assert torch.equal(out, want) and not torch.equal(out, old_exit_tokens)
    assert "exit_copies_rebuilt" not in river.river_stats  # the load already rebuilt them


def test_the_wrapped_names_still_load_and_exit_copy_entries_are_ignored():
    """State dicts written before issue 36 (``layers.N.backbone.``, ``lm_head.backbone.`` and the
    exit copies' entries) load too: the backbone entries into the backbone, the exit entries
    dropped (the copies are rebuilt from the backbone)."""
    base = tiny()
    river = river_of(base)
    new = perturbed(base)
    old_style = {}
    for k, v in new.state_dict().items():
        if k.startswith("model.layers."):
            _, _, idx, rest = k.split(".", 3)
            k = f"model.layers.{idx}.backbone.{rest}"
        elif k.startswith("lm_head."):
            k = "lm_head.backbone." + k[len("lm_head."):]
        old_style[k] = v
    old_style["model.layers.0.exit_layer.input_layernorm.weight"] = torch.full((128,), 7.0)
    result = river.load_state_dict(old_style)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(river.model.layers[0].exit_layer.input_layernorm.weight, new.model.layers[0].input_layernorm.weight)
    ids = prompt()
    assert torch.equal(river.generate(ids, max_new_tokens=12, **GEN), new.generate(ids, max_new_tokens=12, **GEN))


def test_a_state_dict_that_lacks_backbone_weights_fails_strictly_with_the_plain_names():
    river = river_of(tiny())
    state = tiny(seed=3).state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.backbone\.mlp\.up_proj\.weight"):
        river.load_state_dict(state)


def test_smollm2_plain_state_dict_loads_strictly(smollm2):
    """The issue's case: SmolLM2-135M's own state dict, with changed weights, into a River model
    (before: 961 missing and 271 unexpected keys, nothing loaded)."""
    plain, tok = smollm2
    river = river_of(plain, tau=2.0, backend="int8", exit_head=None)
    new = perturbed(plain, scale=0.2)
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    ref = new.generate(ids, max_new_tokens=8, **GEN)
    assert not torch.equal(ref, plain.generate(ids, max_new_tokens=8, **GEN))
    assert set(river.state_dict()) == set(plain.state_dict())
    result = river.load_state_dict(new.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(river.generate(ids, max_new_tokens=8, **GEN), ref)
    with river.river_mode("lossless"):
        assert torch.equal(river.generate(ids, max_new_tokens=8, **GEN), ref)


# -- PEFT ---------------------------------------------------------------------------------------


def _lora(model, seed: int = 1):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)  # the same random (nonzero) A and B on both models
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _is_lora(module) -> bool:
    return type(module).__module__.startswith("peft.")


def test_lora_wraps_the_backbone_only_and_changes_river_as_it_changes_the_plain_model():
    peft = pytest.importorskip("peft")
    base = tiny()
    river = river_of(base)
    with river.river_mode("exit"):
        exit_before = river.generate(prompt(), max_new_tokens=12, **GEN)
    plain_lora, river_lora = _lora(copy.deepcopy(base)), _lora(river)
    ids = prompt()
    ref = plain_lora.generate(input_ids=ids, max_new_tokens=12, **GEN)
    assert not torch.equal(ref, base.generate(ids, max_new_tokens=12, **GEN))  # the adapter matters
    assert torch.equal(river_lora.generate(input_ids=ids, max_new_tokens=12, **GEN), ref)  # tau = 2
    wrapped = [n for n, m in river_lora.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(wrapped) == 2 * 4 and all(".self_attn." in n and "exit" not in n for n in wrapped)
    assert sorted(wrapped) == sorted(n for n, m in plain_lora.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert not any(_is_lora(m) for _, m in exit_modules(river))
    # the adapter's own keys are the plain model's: an adapter saved from one loads into the other
    assert set(peft.get_peft_model_state_dict(river_lora)) == set(peft.get_peft_model_state_dict(plain_lora))
    # unmerged, the exit copies are those of the base weights: the exit path has no adapter
    with river.river_mode("exit"):
        assert torch.equal(river_lora.generate(input_ids=ids, max_new_tokens=12, **GEN), exit_before)
    # merged, the exit copies follow the merged weights at the next generate
    merged_plain, merged = plain_lora.merge_and_unload(), river_lora.merge_and_unload()
    assert merged is river
    assert torch.equal(merged.generate(ids, max_new_tokens=12, **GEN), merged_plain.generate(ids, max_new_tokens=12, **GEN))
    assert merged.river_stats["exit_copies_rebuilt"] == [f"layers.{i}" for i in range(4)]
    fresh = river_of(merged_plain)
    with merged.river_mode("exit"), fresh.river_mode("exit"):
        assert torch.equal(merged.generate(ids, max_new_tokens=12, **GEN), fresh.generate(ids, max_new_tokens=12, **GEN))
    assert not any(_is_lora(m) for m in merged.modules()) and not any(_is_lora(m) for _, m in exit_modules(merged))


def test_a_rebuild_while_an_adapter_is_attached_copies_the_base_weights_without_it():
    """Changed base weights under an unmerged adapter: the exit copy is rebuilt from the new base
    weights and holds no LoRA module; training the adapter (its own Linears) rebuilds nothing."""
    base = tiny()
    river = river_of(base)
    river_lora = _lora(river)
    new = perturbed(base)
    with torch.no_grad():
        river.model.layers[2].backbone.mlp.down_proj.weight.copy_(new.model.layers[2].mlp.down_proj.weight)
    assert river.river_refresh_exit_layers() == ["layers.2"]
    assert not any(_is_lora(m) for _, m in exit_modules(river))
    with torch.no_grad():
        for n, p in river_lora.named_parameters():
            if "lora_B" in n:
                p.add_(1.0)
    assert river.river_refresh_exit_layers() == []
