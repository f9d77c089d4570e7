"""``river-hf stitch`` on tiny random Qwen2 models saved to folders with a tiny byte-level Qwen2 tokenizer
(257 tokens; the models have 320 output rows, so the padded-vocabulary cut is exercised too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from river_hf.cli import main
from river_hf.stitch.cli import marked_text

from test_stitch import _word_tokenizer, tiny_qwen

WORDS = [f"w{i}" for i in range(60)]


def _byte_tokenizer(reverse: bool = False):
    """A Qwen2Tokenizer over the 256 byte-level symbols, no merges (AutoTokenizer reloads Qwen2 folders
    as Qwen2Tokenizer, so the saved tokenizer must be one); ``reverse`` gives a different vocabulary."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alpha = sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=reverse)
    return Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alpha)}, merges=[])


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stitch_cli")
    tok = _byte_tokenizer()
    out = {}
    for name, (h, layers, seed) in {"slm": (32, 2, 1), "llm": (64, 3, 2)}.items():
        d = root / name
        model = tiny_qwen(h, layers, 320, seed=seed)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = str(d)
    other = root / "other_tok"
    tiny_qwen(64, 3, 320, seed=3).save_pretrained(other)
    _byte_tokenizer(reverse=True).save_pretrained(other)
    out["other"] = str(other)
    return out


def test_cli_json_output(tiny_dirs, capsys):
    rc = main(["stitch", "def f(x):", "--slm", tiny_dirs["slm"], "--llm", tiny_dirs["llm"], "--tau", "0.5",
               "--max-new-tokens", "6", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    st = res["stats"]
    assert st["new_tokens"] == len(res["sources"]) and 1 <= st["new_tokens"] <= 6
    assert st["slm_tokens"] == res["sources"].count(0) and st["llm_tokens"] == res["sources"].count(1)
    assert res["tau"] == 0.5


def test_cli_text_output_marks_slm_tokens_and_compare(tiny_dirs, capsys):
    rc = main(["stitch", "print(1)", "--slm", tiny_dirs["slm"], "--llm", tiny_dirs["llm"], "--tau", "1",
               "--max-new-tokens", "4", "--compare"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("[[")  # τ = 1: every token is the SLM's, marked with brackets off a TTY
    assert "R-Stitch tau=1:" in out and "SLM 4 (100%" in out and "hand-overs 0" in out
    assert "llm_only" in out and "assisted" in out and "speedup vs LLM-only" in out


def test_marked_text_runs():
    tok = _word_tokenizer(WORDS)
    ids = tok.convert_tokens_to_ids(["w1", "w2", "w3", "w4"])
    assert marked_text(tok, ids, [0, 0, 1, 0], colour=False) == "[[w1 w2]]w3[[w4]]"
    assert marked_text(tok, ids, [1, 1, 1, 1], colour=True) == "w1 w2 w3 w4"
    assert "\033[32m" in marked_text(tok, ids, [0, 1, 1, 1], colour=True)


def test_cli_errors_exit_2(tiny_dirs, capsys):
    assert main(["stitch", "w1", "--slm", tiny_dirs["slm"], "--llm", tiny_dirs["other"]]) == 2
    assert "different tokenizers" in capsys.readouterr().err
    assert main(["stitch", "w1", "--slm", tiny_dirs["slm"], "--llm", tiny_dirs["llm"], "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
    assert main(["stitch", "w1", "--slm", "no-such-model", "--llm", tiny_dirs["llm"]]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["stitch", "w1", "--slm", "no-such-model", "--llm", "no-such-model", "--tau", "nan"]) == 2
    assert "--tau" in capsys.readouterr().err  # refused before any model is resolved


def test_cli_subprocess(tiny_dirs):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    r = subprocess.run([sys.executable, "-m", "river_hf.cli", "stitch", "--help"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "--compare" in r.stdout and "--tau" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "river_hf.cli", "stitch", "w1 w2", "--slm", tiny_dirs["slm"], "--llm", tiny_dirs["llm"],
         "--tau", "-1", "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["sources"] == [1] * res["stats"]["new_tokens"] and res["stats"]["slm_forwards"] == 0
