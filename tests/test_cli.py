"""The `river-hf` command line: the main job on the real SmolLM2, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "river_hf.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.real_model
def test_generate_json_with_compare(smollm2_path):
    res = run_cli("generate", "What is the capital of France?", "--model", "smollm2-135m", "--tau", "2",
                  "--max-new-tokens", "8", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "Paris" in out["text"]
    assert out["token_match_rate"] == 1.0  # τ > 1: identical to the unmodified model
    assert out["stats"]["tokens_per_s"] > 0 and out["baseline"]["stats"]["tokens_per_s"] > 0
    assert out["river_config"]["tau"] == 2.0
    # --compare times both side by side: equal token counts, repeats, median and min-max speedup, a verdict.
    sp = out["speedup"]
    assert len(sp["runs"]) == 3 and sp["min"] <= sp["median"] <= sp["max"]
    assert out["verdict"] in ("faster", "slower", "not resolved")
    rows = {r["label"]: r for r in out["comparison"]["rows"]}
    assert rows["River"]["new_tokens"] == rows["unmodified"]["new_tokens"] == out["timed_new_tokens"]
    assert out["comparison"]["stream_triad_gb_s"] > 0
    assert out["comparison"]["reference_kind"].startswith("plain transformers model (LlamaForCausalLM")
    # The statistics are River's own answer's, not those of the unmodified answer or a timed run after it.
    assert out["stats"]["mode"] == "route" and out["baseline"]["stats"]["mode"] == "backbone"
    assert out["stats"]["new_tokens"] == out["new_tokens"] and out["exit_fraction"] == 0.0  # τ > 1 never exits
    assert "--compare: timing River and the unmodified model" in res.stderr  # progress on stderr, JSON on stdout


@pytest.mark.real_model
def test_generate_lossless_compare_gives_the_unmodified_tokens(smollm2_path):
    res = run_cli("generate", "Name three colours.", "--model", "smollm2-135m", "--tau", "0.5",
                  "--lossless", "--draft-tokens", "3", "--draft-schedule", "heuristic", "--max-new-tokens", "16", "--compare",
                  "--repeats", "1", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_match_rate"] == 1.0 and out["text"] == out["baseline"]["text"]
    ll = out["stats"]["lossless"]
    assert out["stats"]["mode"] == "lossless" and ll["drafted"] > 0 and 0 <= ll["acceptance_rate"] <= 1
    assert out["river_config"]["draft_tokens"] == 3 and out["river_config"]["draft_schedule"] == "heuristic"
    assert (ll["draft_tokens"], ll["draft_schedule"]) == (3, "heuristic")  # what the call ran with
    assert {r["label"] for r in out["comparison"]["rows"]} == {"River lossless", "unmodified"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--draft-tokens", "3"], "add --lossless"),
        (["generate", "hi", "--draft-schedule", "constant"], "add --lossless"),
        (["generate", "hi", "--lossless", "--draft-tokens", "20"], "max_draft_tokens (15)"),  # before any load
        (["generate", "hi", "--lossless", "--draft-schedule", "fastest"], "invalid choice"),
        (["generate", "hi", "--lossless", "--prefill", "route"], "lossless mode always reads it with the backbone"),
        (["generate", "   "], "prompt is empty"),
        (["generate", "hi", "--tau", "fast"], "--tau must be a number"),
        (["generate", "hi", "--model", "no-such-model"], "unknown model"),
        (["generate", "hi", "--max-new-tokens", "0"], "at least 1"),
        (["generate", "hi", "--device", "xyz"], "--device must be"),
        (["generate", "hi", "--model", "smollm2-135m", "--backend", "foo"], "unknown quantization backend"),
        (["generate", "hi", "--model", "smollm2-135m", "--exit-head", "int3"], "unknown quantization backend"),
        (["generate", "hi", "--prefill", "sometimes"], "invalid choice"),
        (["generate", "hi", "--repeats", "0"], "expected a positive integer"),
        (["bench", "--prompts", "0"], "expected a positive integer"),
        (["generate", "hi", "--model", "smollm2-135m", "--max-new-tokens", "100000000"], "does not fit"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    res = run_cli(*args, timeout=120)
    assert res.returncode == 2
    lines = [l for l in res.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr


def test_draft_flags_are_checked_in_their_own_words():
    """``--draft-tokens`` above ``max_draft_tokens`` names the flag and the cap (RiverConfig's own
    error names a field the user never set); both flags land in the config."""
    from river_hf import RiverConfig
    from river_hf.cli_args import with_draft_flags
    from river_hf.errors import RiverError

    config = RiverConfig(max_draft_tokens=15)
    with pytest.raises(RiverError, match=r"--draft-tokens 20 is more than this model's max_draft_tokens \(15\).*at most 15"):
        with_draft_flags(config, 20)
    got = with_draft_flags(config, 15, "constant")
    assert (got.draft_tokens, got.draft_schedule, got.max_draft_tokens) == (15, "constant", 15)
    assert with_draft_flags(config) is config


def test_help_lists_generate():
    res = run_cli("--help", timeout=60)
    assert res.returncode == 0 and "generate" in res.stdout


def test_convert_refuses_a_folder_that_is_not_river(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    res = run_cli("convert", "smollm2-135m", str(tmp_path), timeout=120)
    assert res.returncode == 2 and "not a River folder" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_package_imports_lazily_and_exposes_subpackages():
    """`import river_hf` (what every CLI call does first) must not import torch; public names and
    the method subpackages load on first access."""
    code = (
        "import sys, river_hf\n"
        "assert 'torch' not in sys.modules, 'import river_hf pulled in torch'\n"
        "assert callable(river_hf.stitch.generate) and callable(river_hf.diffusion.generate)\n"
        "assert river_hf.RiverForCausalLM.__name__ == 'RiverForCausalLM'\n"
        "assert {'stitch', 'diffusion', 'RiverConfig'} <= set(dir(river_hf))\n"
        "try:\n    river_hf.no_such_name\nexcept AttributeError:\n    print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# -- one check for generate, convert and from_pretrained (issue 21) ---------------------------------


def _tiny_model_folder(folder, tokenizer: bool = True, context: int = 128):
    """A tiny random Llama (4 layers) saved as a plain folder, with a word-level tokenizer unless told not to."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


def _broken_folder(tmp_path, kind: str):
    folder = _tiny_model_folder(tmp_path / kind, tokenizer=kind != "no-tokenizer")
    if kind == "bad-json":
        (folder / "config.json").write_text("{not json")
    elif kind == "unknown-type":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["model_type"] = "no_such_type"
        (folder / "config.json").write_text(json.dumps(cfg))
    elif kind in ("wrong-type", "shape-mismatch"):
        cfg = json.loads((folder / "config.json").read_text())
        if kind == "wrong-type":
            cfg["hidden_size"] = "abc"  # transformers' strict config dataclass refuses it (not a ValueError)
        else:
            cfg["intermediate_size"] = 96  # a valid config that does not match the saved weights (128)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("kind, message", [("bad-json", "cannot read the model config"),
                                           ("unknown-type", "cannot read the model config"),
                                           ("wrong-type", "cannot read the model config"),
                                           ("shape-mismatch", "do not match the shapes its config.json gives"),
                                           ("no-tokenizer", "holds no tokenizer")])
def test_generate_and_convert_refuse_a_broken_folder_with_one_line(tmp_path, capsys, kind, message):
    from river_hf.cli import main

    folder = str(_broken_folder(tmp_path, kind))
    capsys.readouterr()
    for argv in (["generate", "hi", "--model", folder, "--max-new-tokens", "2", "--no-progress"],
                 ["convert", folder, str(tmp_path / "out")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        if kind == "shape-mismatch":  # transformers' load report (naming the tensors) comes first, then one line
            # (exit 2 means the RiverError path: a crash exits 1; the load report is all that precedes the line)
            assert err.strip().splitlines()[-1].startswith("river-hf: error:"), (argv, err)
            assert message in err.strip().splitlines()[-1]
            continue
        assert err.startswith("river-hf: error:") and err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "out").exists()
    from river_hf import RiverError
    from river_hf.river.cli import check_model

    if kind != "shape-mismatch":  # (the weights are read only by the load itself)
        with pytest.raises(RiverError, match=message):  # the one shared check, as a function
            check_model(folder)
    if kind != "no-tokenizer":  # from_pretrained needs no tokenizer; its config error is the same one
        from river_hf import RiverForCausalLM

        with pytest.raises(RiverError, match=message):
            RiverForCausalLM.from_pretrained(folder, progress=False)


def _enospc_safetensors(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


def _enospc_os(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("writer", [_enospc_safetensors, _enospc_os])
def test_convert_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, writer):
    import transformers.modeling_utils as mu

    from river_hf.cli import main

    src = _tiny_model_folder(tmp_path / "src")
    (tmp_path / "outs").mkdir()
    monkeypatch.setattr(mu, "safe_save_file", writer)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "outs" / "river"), "--backend", "copy"]) == 2
    err = capsys.readouterr().err  # the load's and the save's progress bars, then the error
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert lines == [err.strip().splitlines()[-1]] and lines[0].startswith("river-hf: error:"), err
    assert "no space left" in lines[0] and "Traceback" not in err
    assert list((tmp_path / "outs").iterdir()) == []  # no folder, no temporary folder


def test_generate_says_what_it_does_during_a_long_prefill_and_compare_unless_no_progress(tmp_path, capsys):
    from river_hf.cli import main

    folder = str(_tiny_model_folder(tmp_path / "tiny", context=2048))
    long_prompt = " ".join(f"w{3 + i % 60}" for i in range(1200))  # 1200 tokens: over LONG_PREFILL_TOKENS
    settings = ["--model", folder, "--max-new-tokens", "3", "--backend", "copy", "--exit-head", "copy", "--tau", "2"]
    capsys.readouterr()
    assert main(["generate", long_prompt, *settings]) == 0
    assert "prefilling 1200 prompt tokens" in capsys.readouterr().err
    assert main(["generate", long_prompt, *settings, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "prefilling" not in err and "Loading weights" not in err  # transformers' bars are off too
    compare = ["generate", "w3 w4 w5", *settings, "--compare", "--repeats", "1", "--json"]
    assert main(compare) == 0
    err = capsys.readouterr().err
    assert "prefilling" not in err  # a short prompt: no note
    assert "--compare: answering with the unmodified model" in err and "--compare: timing River" in err
    assert "timing: 100%" in err  # the tqdm bar over the timed rounds
    assert main([*compare, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "--compare" not in err and "timing:" not in err


@pytest.mark.parametrize("lossless", [False, True], ids=["route", "lossless"])
def test_a_negative_tau_gets_one_line_saying_what_it_means_and_the_answer(tmp_path, lossless):
    """`generate --tau -1` runs (exit 0) and stderr holds one line of the CLI's own, not the library's
    UserWarning as well: route mode runs on the exit path (approximate tokens), lossless drafts there."""
    folder = str(_tiny_model_folder(tmp_path / "tiny"))
    res = run_cli("generate", "w3 w4", "--model", folder, "--tau", "-1", "--max-new-tokens", "3", "--backend", "copy",
                  "--exit-head", "copy", "--no-progress", *(["--lossless"] if lossless else []), timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("river-hf: warning: --tau -1 is negative"), res.stderr
    expected = "the answer is still the unmodified model's tokens" if lossless else "approximate tokens"
    assert expected in lines[0] and "tau=-1 is negative" not in res.stderr
    assert ("River lossless" if lossless else "100% of decode steps exited") in res.stdout


def test_only_a_negative_tau_gets_a_note():
    from river_hf.cli_args import negative_tau_note

    assert negative_tau_note(None) is None and negative_tau_note(0.0) is None and negative_tau_note(2.0) is None
    assert "(nearly) every decode step" in negative_tau_note(-0.5) and "so every decode step" in negative_tau_note(-2)


def test_a_closed_pipe_ends_a_listing_quietly(tmp_path):
    """`river-hf kernels --list | head -1`: the reader closes the pipe; the command stops with exit 0 and
    no BrokenPipeError traceback."""
    import subprocess
    import sys

    cache = tmp_path / "kernels.json"
    entries = {f"cpu|{i}x{i}|float32|False|torch-int4": {} for i in range(64, 64 + 4000)}  # past the 64 KB pipe buffer
    cache.write_text(json.dumps({"format": 2, "entries": entries}))
    cmd = (f"{sys.executable} -m river_hf.cli kernels --list --file {cache} | head -1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0 and done.stdout.count("\n") == 1, (done.returncode, done.stdout, done.stderr)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_failed_write_to_stdout_is_one_error_line(tmp_path, tiny_folder):
    """`river-hf ... > /dev/full` (issue 40): one `river-hf: error:` line and exit 1, no OSError
    traceback: the streamed answer of generate (written and flushed token by token) and a
    listing that is only buffered until the end."""
    cache = tmp_path / "kernels.json"
    cache.write_text(json.dumps({"format": 2, "entries": {"cpu|64x64|float32|False|torch-int4": {}}}))
    commands = (["kernels", "--list", "--file", str(cache)],
                ["generate", "--model", tiny_folder, "--max-new-tokens", "3", "--no-progress", "hi"])
    for command in commands:
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "river_hf.cli", *command], stdout=full, stderr=subprocess.PIPE,
                                  text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1, (command, done.stderr)
        assert lines == ["river-hf: error: cannot write to standard output: No space left on device"], lines


def test_an_oserror_that_is_not_stdouts_keeps_its_traceback(monkeypatch):
    """Only a failed write to standard output becomes the one-line error; any other OSError (here a
    full disk while writing a file) propagates with its traceback."""
    import argparse

    import river_hf.cli as cli

    def fails(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.OneLineParser, "parse_args", lambda self, argv=None: argparse.Namespace(func=fails))
    with pytest.raises(OSError, match="No space left"):
        cli.main(["kernels"])


def test_the_stats_line_names_the_kernel_river_ran_its_backbone_linears_on():
    from types import SimpleNamespace

    from river_hf.river.cli import _stats_line

    model = SimpleNamespace(river_config=SimpleNamespace(tau=0.9))
    stats = {"new_tokens": 8, "seconds": 1.0, "tokens_per_s": 8.0, "mean_exit_layer": 3.0, "num_layers": 24,
             "exit_fraction": 0.5, "backbone_kernel": {"kernel": "river-grid"}}
    assert _stats_line("River", stats, model).endswith("50% of decode steps exited, backbone Linears on river-grid")
    for kernel in ({"kernel": "torch"}, None):
        assert "backbone Linears" not in _stats_line("River", {**stats, "backbone_kernel": kernel}, model)
