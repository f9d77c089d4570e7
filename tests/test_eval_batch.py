"""``river-hf eval --batch N``: GSM8K and HumanEval items generated N at a time (left-padded, one
``generate`` call per batch) give the completions of batch 1; bad values are one error, exit 2.

A tiny random Llama (SmolLM2's tokenizer) for the command and for a row that ends early at EOS;
SmolLM2-135M for HumanEval, where the trained model closes its code block at different lengths
per problem (the rows the code-block criterion ends are padded after their end).
"""

from __future__ import annotations

import json

import pytest
import torch

from river_hf.cli import main


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_a_batch_that_is_not_positive_is_one_error(bad, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:  # argparse's own refusal: one line, exit 2
        main(["eval", "--task", "gsm8k", "--batch", bad, "--out", str(tmp_path / "r.json")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--batch" in err and "positive integer" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_agreement_refuses_a_batch_before_the_model_loads(capsys):
    assert main(["eval", "--task", "agreement", "--batch", "2", "--model", "no-such-model-key"]) == 2
    err = capsys.readouterr().err
    assert "--batch is for gsm8k and humaneval" in err and len(err.strip().splitlines()) == 1


def test_gsm8k_batch_2_gives_the_completions_of_batch_1(tiny_folder, gsm8k_file, tmp_path):
    """τ 2 (River never exits: the plain model's greedy tokens) and τ 0.5, two questions of
    different lengths: the same outputs, token counts and answers; the report says the batch size,
    and the batch's tokens count every row once."""
    reports = {}
    for batch in (1, 2):
        out = tmp_path / f"b{batch}.json"
        assert main(["eval", "--task", "gsm8k", "--model", tiny_folder, "--data", gsm8k_file, "--tau", "2",
                     "--limit", "2", "--max-new-tokens", "6", "--batch", str(batch), "--backend", "copy",
                     "--out", str(out), "--no-progress"]) == 0
        reports[batch] = json.loads(out.read_text())
    one, two = reports[1], reports[2]
    assert one["batch_size"] == 1 and two["batch_size"] == 2
    for a, b in zip(one["results"], two["results"]):
        assert [s["output"] for s in a["samples"]] == [s["output"] for s in b["samples"]]
        assert [s["new_tokens"] for s in a["samples"]] == [s["new_tokens"] for s in b["samples"]]
        assert a["exact_match"] == b["exact_match"] and a["new_tokens"] == b["new_tokens"] == 12
        assert a["mean_exit_layer"] == b["mean_exit_layer"] == 4.0  # τ 2: every step on the backbone
        assert a["decode_steps"] == 10 and b["decode_steps"] == 5  # one pass per step for both rows


def test_a_row_that_ends_early_at_eos_keeps_its_own_length(tiny_folder):
    """A batch of two prompts whose first row emits the EOS early: that row's completion
    and token count are the ones it gets alone (the padding after its end is left out)."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM
    from river_hf.eval.tasks import _generate
    from river_hf.models import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    model = RiverForCausalLM.from_pretrained(tiny_folder, tau=2.0, backend="copy", progress=False).eval()
    texts = ["Tom has 3 apples and buys 4 more. How many apples?", "Hello"]
    free = []
    for text in texts:
        ids = encode_prompt(tok, text)["input_ids"]
        with torch.no_grad():
            free.append(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist())
    # the first token of row 0 after its first that neither row emitted before: as EOS it ends row 0 only
    end, stop = next((j + 1, t) for j, t in enumerate(free[0]) if j and t not in free[0][:j] + free[1])
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [*(eos if isinstance(eos, list) else [eos]), stop]
    try:
        together, call = _generate(model, tok, texts, 8)
        alone = [_generate(model, tok, [t], 8)[0][0] for t in texts]
    finally:
        model.generation_config.eos_token_id = eos
    assert together == alone and together[0]["new_tokens"] == end < 8 == together[1]["new_tokens"]
    assert call["decode_rows"] == 2 * call["decode_steps"]


@pytest.mark.real_model
def test_humaneval_batches_give_the_completions_of_batch_1(smollm2_path):
    """SmolLM2-135M, τ 2: problem 0's code block closes at about 40 tokens, problem 1 runs to the
    budget; batch 2 gives each problem its batch-1 completion, token count and result."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM
    from river_hf.eval.tasks import run_humaneval

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = RiverForCausalLM.from_pretrained(smollm2_path, progress=False)
    runs = [run_humaneval(model, tok, [2.0], limit=2, max_new_tokens=60, allow_code_execution=True, timeout=5,
                          batch_size=b, progress=False)["results"][0] for b in (1, 2)]
    one, two = ([(s["completion"], s["new_tokens"], s["passed"]) for s in r["samples"]] for r in runs)
    assert one == two
    lengths = [n for _, n, _ in one]
    assert lengths[0] < 60 == lengths[1]  # the code-block criterion ended row 0 early
    assert runs[0]["new_tokens"] == runs[1]["new_tokens"] == sum(lengths)
    assert torch.isclose(torch.tensor(runs[0]["mean_exit_layer"]), torch.tensor(runs[1]["mean_exit_layer"]))
