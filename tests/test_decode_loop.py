"""River's decoding loop for exit mode (``river.decode_loop.exit_decode``, generate's ``custom_generate``):
the same tokens, scores and logits as transformers' ``_sample`` bit for bit; the calls it does not serve run
transformers' loop."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverConfig, enable_river
from river_hf.river import decode_loop, modeling


def _tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def river(request):
    backend = "river-int4" if decode_loop_kernel() else "torch-int4"
    config = RiverConfig(backend=backend, exit_head=backend, exit_layer_impl="auto", fuse_projections=True)
    return enable_river(_tiny(request.param), config=config)


def decode_loop_kernel() -> bool:
    from river_hf.quant import river_int4

    return river_int4.works()


def _inputs(batch: int):
    ids = torch.randint(3, 256, (batch, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :4], mask[0, :4] = 0, 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def _run(river, monkeypatch, ours: bool, seed=None, **gen):
    """``generate`` in exit mode through River's loop (``ours``) or transformers' (``serves_call`` off): the
    output and how many calls River's loop ran itself (a call it hands back to ``_sample`` counts 0)."""
    taken = []
    real = decode_loop.exit_decode
    handed_back = decode_loop.sample_loop

    def counted(*args, **kwargs):
        taken.append(1)
        return real(*args, **kwargs)

    def refused(*args, **kwargs):  # the loop handed the call to transformers' _sample
        taken.append(-1)
        return handed_back(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(modeling, "exit_decode", counted)
        m.setattr(decode_loop, "sample_loop", refused)
        if not ours:
            m.setattr(modeling, "serves_call", lambda *a, **k: False)
        if seed is not None:
            torch.manual_seed(seed)
        with river.river_mode("exit"), torch.no_grad():
            return river.generate(**gen), sum(taken)


def _both(river, monkeypatch, seed=None, **gen):
    """:func:`_run` through River's loop, then through transformers'."""
    return [_run(river, monkeypatch, ours, seed, **gen) for ours in (True, False)]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_scores_and_logits_are_transformers_own(river, monkeypatch, batch):
    (out, taken), (ref, taken_ref) = _both(river, monkeypatch, **_inputs(batch), max_new_tokens=7, do_sample=False,
                                           return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert taken == 1 and taken_ref == 0
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores)) and len(out.scores) == 7
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits)) and len(out.logits) == 7
    assert out.cache.get_seq_length() == ref.cache.get_seq_length()
    assert river.river_stats["mode"] == "exit"


def test_sampling_draws_the_same_tokens_from_the_same_seed(river, monkeypatch):
    (out, taken), (ref, _) = _both(river, monkeypatch, seed=3, **_inputs(3), max_new_tokens=6, do_sample=True,
                                   temperature=0.8, top_k=20)
    assert taken == 1 and torch.equal(out, ref)


def test_a_row_that_stops_gets_the_pad_token_and_the_call_ends_with_the_last_row(river, monkeypatch):
    gen = dict(_inputs(3), max_new_tokens=8, do_sample=False)
    with river.river_mode("exit"), torch.no_grad():
        first = river.generate(**gen)
    eos = int(first[1, 11])  # row 1's third new token (or an earlier one, if it came before)
    (out, taken), (ref, _) = _both(river, monkeypatch, **gen, eos_token_id=eos)
    assert taken == 1 and torch.equal(out, ref)
    new = out[1, 9:]
    stop = int((new == eos).nonzero()[0])  # row 1's first EOS: pad after it, while another row goes on
    assert stop + 1 < new.shape[0] and (new[stop + 1:] == 0).all()


def test_one_new_token(river, monkeypatch):
    (out, taken), (ref, _) = _both(river, monkeypatch, **_inputs(1), max_new_tokens=1, do_sample=False)
    assert taken == 1 and torch.equal(out, ref) and out.shape[1] == 10


def test_a_streamer_gets_what_generate_gives_it(river, monkeypatch):
    """transformers hands a custom loop no streamer; River passes the call's on, which gets the prompt, each
    step's tokens and ``end``, as from transformers' loop."""
    records = []
    for ours in (True, False):
        streamer = _Recorder()
        out, taken = _run(river, monkeypatch, ours, **_inputs(1), max_new_tokens=5, do_sample=False,
                          streamer=streamer)
        records.append((out, taken, streamer.puts, streamer.ended))
    (out, taken, puts, ended), (ref, taken_ref, puts_ref, ended_ref) = records
    assert taken == 1 and taken_ref == 0 and torch.equal(out, ref)
    assert len(puts) == len(puts_ref) == 6 and all(torch.equal(a, b) for a, b in zip(puts, puts_ref))
    assert ended == ended_ref == 1


@pytest.mark.parametrize("case", ["beams", "hidden states", "route", "stop strings"])
def test_calls_it_does_not_serve_run_transformers_loop(river, monkeypatch, smollm2_path, case):
    """Stop strings need the call's tokenizer, which transformers drops for a custom loop: they run its own."""
    from transformers import AutoTokenizer

    gen = dict(_inputs(1), max_new_tokens=4, do_sample=False)
    if case == "beams":
        gen["num_beams"] = 2
    elif case == "hidden states":
        gen.update(output_hidden_states=True, return_dict_in_generate=True)
    elif case == "stop strings":
        gen.update(stop_strings=["zz"], tokenizer=AutoTokenizer.from_pretrained(smollm2_path))
    taken = []
    monkeypatch.setattr(modeling, "exit_decode", lambda *a, **k: taken.append(1))
    with river.river_mode("route" if case == "route" else "exit"), torch.no_grad():
        out = river.generate(**gen)
    assert not taken and out is not None


class _Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1
