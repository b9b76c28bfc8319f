"""training.generate: rebuild a TP=1/PP=1 model from a TP=2 or PP=2 checkpoint, and sample from it."""

import argparse
import os
import re

import pytest
import torch

from distributed import run_distributed
from meshlm.data.gpt_dataset import build_datasets
from meshlm.training import generate, trainer
from test_trainer import tiny_config


def _train_tp2_and_pp2(rank, world, tmp):
    out = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        cfg = tiny_config(os.path.join(tmp, name), tp=tp, pp=pp, iters=2)
        cfg.training.eval_interval = 2
        cfg.checkpoint.save = os.path.join(tmp, name, "ckpt")
        out[name] = trainer.pretrain(cfg)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gen"))
    return tmp, run_distributed(_train_tp2_and_pp2, 2, tmp)[0]


def _val_loss_single_process(model, tmp, name):
    """The first evaluation's loss (eval_iters × global batch validation samples) at TP=1/PP=1."""
    cfg = tiny_config(os.path.join(tmp, name))
    _, valid, _ = build_datasets(cfg, world_size=2)
    n = cfg.training.eval_iters * cfg.training.global_batch_size
    batch = [valid[i] for i in range(n)]
    tokens = torch.stack([b["tokens"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    with torch.no_grad():
        return model(tokens, labels=labels).mean().item()


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_model_rebuilt_from_a_sharded_checkpoint_computes_the_trained_function(trained, name):
    tmp, summary = trained
    model, tokenizer = generate.load_model(os.path.join(tmp, name, "ckpt"))
    assert tokenizer.vocab_size == 100
    expected = summary[name]["last_val_loss"]  # evaluated by the TP=2 / PP=2 run at iteration 2
    assert abs(_val_loss_single_process(model, tmp, name) - expected) / expected < 1e-5


def _args(load, **kw):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    argv = ["--load", load, "--prompt", "5 17 3", "--max-new-tokens", "6"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv)


def test_greedy_generation_is_the_argmax_continuation(trained, capsys):
    tmp, _ = trained
    load = os.path.join(tmp, "tp2", "ckpt")
    assert generate.run(_args(load, temperature=0)) == 0
    printed = capsys.readouterr().out.split()
    model, tok = generate.load_model(load)
    ids = [5, 17, 3]
    for _ in range(6):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1, :tok.vocab_size].argmax())
        if nxt == tok.eod:
            break
        ids.append(nxt)
    assert printed == [str(i) for i in ids]


def test_a_prompt_and_new_tokens_beyond_the_context_are_refused_naming_the_flag(trained, capsys):
    """Megatron's rule: prompt + tokens to generate ≤ the model's positions. --max-new-tokens had no
    upper bound (10**9 re-ran the model a billion times over a cropped window: a hang)."""
    from meshlm.cli import main
    tmp, _ = trained
    load = os.path.join(tmp, "tp2", "ckpt")
    context = generate.load_model(load)[0].max_context
    argv = ["generate", "--load", load, "--temperature", "0", "--prompt", "5 17 3"]
    assert main(argv + ["--max-new-tokens", str(10**9)]) == 2
    err = capsys.readouterr().err
    assert err == (f"meshlm: error: --max-new-tokens {10**9} and the prompt's 3 tokens exceed this model's context "
                   f"of {context} (its --seq-length, which sized its positions); use --max-new-tokens {context - 3} "
                   f"or less\n")
    assert main(argv + ["--max-new-tokens", str(context - 3)]) == 0  # the bound itself runs
    assert len(capsys.readouterr().out.split()) <= context
    assert context - 3 < generate.DEFAULT_NEW_TOKENS  # no flag: the default was refused on this short model
    assert main(argv) == 0 and len(capsys.readouterr().out.split()) <= context
    long = ["generate", "--load", load, "--max-new-tokens", "0", "--prompt", " ".join(["5"] * (context + 1))]
    assert main(long) == 2
    assert capsys.readouterr().err == (f"meshlm: error: --prompt is {context + 1} tokens, more than this model's "
                                       f"context of {context} (its --seq-length, which sized its positions); give "
                                       f"a prompt of at most {context} tokens\n")


def test_top_k_1_and_tiny_top_p_sample_the_greedy_token(trained):
    tmp, _ = trained
    model, tok = generate.load_model(os.path.join(tmp, "tp2", "ckpt"))
    greedy = generate.sample_text(model, tok, "1 2 3", max_new_tokens=5, temperature=0)
    assert generate.sample_text(model, tok, "1 2 3", max_new_tokens=5, top_k=1, seed=7) == greedy
    assert generate.sample_text(model, tok, "1 2 3", max_new_tokens=5, top_p=1e-6, seed=7) == greedy
    a = generate.sample_text(model, tok, "1 2 3", max_new_tokens=5, temperature=2.0, seed=11)
    assert a == generate.sample_text(model, tok, "1 2 3", max_new_tokens=5, temperature=2.0, seed=11)


def test_the_pipeline_run_logged_its_bubble_and_timeline(trained):
    """Side check on the PP=2 training run above: metrics.jsonl carries the schedule's bubble."""
    import json
    tmp, _ = trained
    path = os.path.join(tmp, "pp2", "logs", "metrics.jsonl")
    train = [json.loads(x) for x in open(path) if "lm_loss" in x]
    assert train and all(0.0 <= r["bubble_fraction"] < 1.0 for r in train)
    events = train[-1]["pipeline_timeline"]
    assert {e["kind"] for e in events} == {"F", "B"}
    assert {e["stage"] for e in events} == {0, 1}  # every stage's events, not only the logging one
    for stage in (0, 1):  # each stage ran one F and one B per micro-batch
        mine = [e for e in events if e["stage"] == stage]
        assert sorted(e["mb"] for e in mine if e["kind"] == "F") == sorted(e["mb"] for e in mine if e["kind"] == "B")


@pytest.mark.parametrize("prompt, message", [
    (None, r"--prompt 'def ' \(the default\): 'def' is not an integer token id; this checkpoint's NullTokenizer"
           r" takes whitespace-separated token ids in \[0, 100\)"),
    ("5 100", r"--prompt '5 100': token id 100 outside \[0, 100\)"),
    ("5 -1", r"--prompt '5 -1': token id -1 outside \[0, 100\)"),
])
def test_a_prompt_the_null_tokenizer_cannot_take_is_a_one_line_error(trained, capsys, prompt, message):
    from meshlm.cli import main
    tmp, _ = trained
    argv = ["generate", "--load", os.path.join(tmp, "tp2", "ckpt"), "--max-new-tokens", "2"]
    assert main(argv + (["--prompt", prompt] if prompt is not None else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.match("meshlm: error: " + message, err), err


@pytest.mark.parametrize("flag, value, message", [
    ("temperature", "nan", "--temperature nan: use a finite number ≥ 0"),
    ("temperature", "inf", "--temperature inf: use a finite number ≥ 0"),
    ("temperature", "-0.5", "--temperature -0.5: use a finite number ≥ 0"),
    ("top-k", "-1", "--top-k -1 is negative"),
    ("top-p", "nan", "--top-p nan: use a number in (0, 1]"),
    ("top-p", "0", "--top-p 0.0: use a number in (0, 1]"),
    ("top-p", "1.5", "--top-p 1.5: use a number in (0, 1]"),
    ("max-new-tokens", "-1", "--max-new-tokens -1 is negative"),
    ("seed", str(2**64), f"--seed {2**64} is out of range"),
    ("seed", "-1", "--seed -1 is out of range; use 0 ≤ seed < 2^64"),
])
def test_numeric_flags_are_checked_before_loading(tmp_path, capsys, flag, value, message):
    from meshlm.cli import main
    absent = str(tmp_path / "no-checkpoint")  # checked first: the error names the flag, not --load
    assert main(["generate", "--load", absent, f"--{flag}", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshlm: error: ") and message in err and err.count("\n") == 1


def test_several_bad_sampling_flags_are_listed_together(tmp_path):
    from meshlm.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        generate.run(_args(str(tmp_path), temperature="nan", top_k=-2))
    assert e.value.problems == ["--temperature nan: use a finite number ≥ 0 (0 = greedy)",
                                "--top-k -2 is negative; use 0 (all tokens) or more"]


def test_a_prompt_that_is_not_unicode_is_refused_for_any_tokenizer():
    from meshlm.data.tokenizer import NullTokenizer
    from meshlm.errors import ConfigError
    with pytest.raises(ConfigError, match="--prompt 'a\\\\udcff' is not valid UTF-8 text"):
        generate.check_prompt(NullTokenizer(100), "a\udcff")  # an undecodable byte of argv
    generate.check_prompt(NullTokenizer(100), "0 99")


def test_a_checkpoint_whose_tokenizer_file_is_gone_names_it_without_a_flag_generate_lacks(tmp_path, capsys):
    """It said "--tokenizer-model /abs/tok.json: no such file", a flag generate does not take."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.cli import main
    from meshlm.config import Config
    cfg = Config()
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = "HuggingFaceTokenizer", str(tmp_path / "gone.json")
    ckpt.save(str(tmp_path / "ck"), 1, {"w": torch.zeros(2)}, config=cfg.to_dict())
    assert main(["generate", "--load", str(tmp_path / "ck")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"meshlm: error: --load {tmp_path / 'ck'}: the tokenizer the run trained with does not load "
        f"(--tokenizer-model {tmp_path / 'gone.json'}: no such file); the checkpoint names it by the run's path: "
        f"put the file back there")
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 2  # its trainer load: the same words
    assert capsys.readouterr().err.strip().endswith(
        f"not loaded through the trainer: the tokenizer the run trained with does not load (--tokenizer-model "
        f"{tmp_path / 'gone.json'}: no such file); the checkpoint names it by the run's path: put the file back there")


def test_a_tokenizer_file_replaced_since_the_run_is_named_not_used(tmp_path, capsys):
    """A tokenizer.json retrained in place (327 ids for a model of 300: the same padded rows) was
    used silently: generate sampled through another vocabulary, convert --to-hf exported it."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.hf_tokenizer import export_tokenizer
    from meshlm.cli import main
    from meshlm.config import Config
    from meshlm.data.tokenizer import train_bpe
    tok = train_bpe(["a b c d e f g"] * 4, 270, str(tmp_path / "tok.json"))
    cfg = Config()
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = "HuggingFaceTokenizer", str(tmp_path / "tok.json")
    rows = tok.vocab_size - 2
    ckpt.save(str(tmp_path / "ck"), 1, {"model/embedding.word_embeddings.weight": torch.zeros(rows, 4)},
              config=cfg.to_dict())
    changed = (f"the tokenizer file {tmp_path / 'tok.json'} gives {tok.vocab_size} ids but the checkpoint's "
               f"vocabulary has {rows}: the file was changed since the run; put the run's tokenizer back there")
    assert main(["generate", "--load", str(tmp_path / "ck")]) == 2
    assert capsys.readouterr().err.strip() == f"meshlm: error: --load {tmp_path / 'ck'}: {changed}"
    (tmp_path / "hf").mkdir()
    assert export_tokenizer(cfg.data, str(tmp_path / "hf"), rows)[:2] == ([], [f"no tokenizer exported: {changed}"])
    assert export_tokenizer(cfg.data, str(tmp_path / "hf"), tok.vocab_size)[0] == ["tokenizer.json",
                                                                                    "tokenizer_config.json"]


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are always ``logits`` (float32, as the model's)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32))
        self.max_context, self.max_context_flag = 64, "its --seq-length"

    def forward(self, x):
        return self.logits.expand(1, x.shape[1], -1)


@pytest.mark.parametrize("sampling", [dict(temperature=1e-300), dict(temperature=5e-324), dict(top_p=1e-300),
                                      dict(temperature=1e-300, top_k=2)])
def test_a_tiny_temperature_or_top_p_samples_the_greedy_token_not_a_nan(sampling):
    """--temperature 1e-300 made float32 logits / T inf and nan, --top-p 1e-300 (0 in float32) dropped
    every id: torch.multinomial's RuntimeError traceback. Both are the argmax's limit."""
    from meshlm.data.tokenizer import NullTokenizer
    model, tok = _FixedLogits([0.5, 3.0, 2.9, -1.0]), NullTokenizer(5)  # eod 4: never sampled
    assert generate.sample_text(model, tok, "0", max_new_tokens=3, seed=1, **sampling) == " 1 1 1"
