"""--tokenizer-type SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer / TikTokenizer:
ids, eod and vocabulary size against megatron-core's own tokenizers (built by its build_tokenizer from
the same flags), the errors, and preprocess → pretrain → generate end to end.

The models are made here: a SentencePiece BPE trained on generated text, and a Megatron tiktoken
JSON vocabulary (the 256 bytes, then every prefix of the corpus words as merges)."""

import base64
import json
import os
import pickle
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

import meshlm
from meshlm.cli import main
from meshlm.config import padded_vocab_size
from meshlm.data.indexed import IndexedDataset, IndexedDatasetWriter
from meshlm.data.tokenizer import TOKENIZER_FIELDS, build_tokenizer
from meshlm.data.tokenizers_extra import TIKTOKEN_PATTERNS, TIKTOKEN_SPECIAL_TOKENS
from meshlm.errors import ConfigError, DataError
from test_launch import clean_env

WORDS = "the quick brown fox jumps over lazy dog tensor pipeline parallel gradient river mountain".split()
TEXTS = ["the quick brown fox", "  two  spaces\tand a tab\n", "naïve café, Ελληνικά, 日本語 🚀", " lead", "",
         "a <s> special </s> token"]
SP_TYPES = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
NUM_SPECIAL = 1000  # Megatron's default --tiktoken-num-special-tokens
SRC = os.path.dirname(os.path.dirname(meshlm.__file__))  # the meshlm under test, for `python -m meshlm`


def corpus(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(n)]


def tok_cfg(kind, model, **kw):
    fields = dict.fromkeys(TOKENIZER_FIELDS)
    fields.update(tokenizer_type=kind, tokenizer_model=str(model), **kw)
    return SimpleNamespace(**fields)


def megatron_cfg(cfg, vocab_size=None):
    """The args megatron-core's build_tokenizer reads, from the same flags."""
    return SimpleNamespace(tokenizer_type=cfg.tokenizer_type, tokenizer_model=cfg.tokenizer_model,
                           tokenizer_sentencepiece_legacy=False, tokenizer_special_tokens=cfg.tokenizer_special_tokens,
                           tokenizer_metadata=None, tiktoken_pattern=cfg.tiktoken_pattern, vocab_size=vocab_size,
                           tiktoken_num_special_tokens=cfg.tiktoken_num_special_tokens or NUM_SPECIAL)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(SentencePiece .model, tiktoken vocabulary .json, its number of entries)."""
    import sentencepiece
    tmp = tmp_path_factory.mktemp("models")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(200)), model_prefix=str(tmp / "sp"), vocab_size=300, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    tokens = [bytes([i]) for i in range(256)]
    for word in WORDS:
        for piece in (word.encode(), b" " + word.encode()):
            tokens += [piece[:k] for k in range(2, len(piece) + 1) if piece[:k] not in tokens]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
             for i, t in enumerate(tokens)]
    (tmp / "tiktoken.json").write_text(json.dumps(vocab))
    return str(tmp / "sp.model"), str(tmp / "tiktoken.json"), len(vocab)


@pytest.fixture(scope="module")
def megatron_build():
    return pytest.importorskip("megatron.core.tokenizers.text.utils.build_tokenizer").build_tokenizer


# ----------------------------------------------------------------------------- SentencePiece


@pytest.mark.parametrize("kind", SP_TYPES)
def test_sentencepiece_types_match_megatron_core(models, megatron_build, kind):
    import sentencepiece
    cfg = tok_cfg(kind, models[0])
    ours, theirs = build_tokenizer(cfg), megatron_build(megatron_cfg(cfg))
    sp = sentencepiece.SentencePieceProcessor(model_file=models[0])
    assert ours.vocab_size == theirs.vocab_size == sp.get_piece_size() == 300
    assert ours.eod == theirs.eod == sp.eos_id() == 2  # the model's </s>
    for text in TEXTS + corpus(5, seed=1):
        ids = ours.encode(text)
        assert ids == theirs.tokenize(text) == sp.encode(text)  # no BOS, no EOS added
        assert ours.decode(ids) == theirs.detokenize(ids) == text  # byte fallback: any text round-trips
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    assert pickle.loads(pickle.dumps(ours)).encode(TEXTS[2]) == ours.encode(TEXTS[2])  # preprocess --workers


def test_a_sentencepiece_models_pad_is_megatrons_pad(tmp_path, megatron_build):
    """Megatron's GPTDataset leaves the tokenizer's pad labels out of the loss; meshlm's SentencePiece
    tokenizer had no pad, so a model with a pad piece trained on them."""
    import sentencepiece
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus(50)), model_prefix=str(tmp_path / "m"),
                                             vocab_size=40, pad_id=3, minloglevel=2)
    cfg = tok_cfg("SentencePieceTokenizer", tmp_path / "m.model")
    assert build_tokenizer(cfg).pad == megatron_build(megatron_cfg(cfg)).pad == 3


def test_a_sentencepiece_model_without_eos_is_refused(tmp_path):
    import sentencepiece
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus(50)), model_prefix=str(tmp_path / "m"),
                                             vocab_size=40, eos_id=-1, minloglevel=2)
    with pytest.raises(DataError, match=r"m.model: the SentencePiece model has no EOS piece"):
        build_tokenizer(tok_cfg("Llama2Tokenizer", tmp_path / "m.model"))


def test_wrong_or_unreadable_model_files_name_the_flag(models, tmp_path):
    hf = tmp_path / "tokenizer.json"
    hf.write_text('{"version": "1.0", "model": {}}')
    with pytest.raises(DataError, match=r"^--tokenizer-model \S+tokenizer.json: not a SentencePiece model .*"
                                        r"HuggingFaceTokenizer\)$"):
        build_tokenizer(tok_cfg("SentencePieceTokenizer", hf))
    with pytest.raises(DataError, match=r"^--tokenizer-model \S+: is a folder"):
        build_tokenizer(tok_cfg("Llama2Tokenizer", tmp_path))
    with pytest.raises(DataError, match=r"^--tokenizer-model \S+sp.model: TikTokenizer reads Megatron's JSON"):
        build_tokenizer(tok_cfg("TikTokenizer", models[0]))
    ranks = tmp_path / "ranks.json"  # tiktoken's own format (base64 token, rank), under a .json name
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    with pytest.raises(DataError, match=r"ranks.json: TikTokenizer reads Megatron's JSON vocabulary .* not this"):
        build_tokenizer(tok_cfg("TikTokenizer", ranks))
    if os.geteuid() != 0:
        locked = tmp_path / "locked.model"
        locked.write_bytes(open(models[0], "rb").read())
        locked.chmod(0)
        with pytest.raises(DataError, match=r"locked.model: cannot read it \(Permission denied\)"):
            build_tokenizer(tok_cfg("SentencePieceTokenizer", locked))


def test_a_missing_library_is_one_line_naming_the_package(models, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ConfigError, match=r"^--tokenizer-type Llama2Tokenizer needs the sentencepiece package: "
                                          r"pip install sentencepiece$"):
        build_tokenizer(tok_cfg("Llama2Tokenizer", models[0]))
    with pytest.raises(ConfigError, match=r"^--tokenizer-type TikTokenizer needs the tiktoken package: "
                                          r"pip install tiktoken$"):
        build_tokenizer(tok_cfg("TikTokenizer", models[1]))


@pytest.mark.slow
def test_meshlm_imports_without_sentencepiece_and_tiktoken():
    code = ("import sys; sys.modules['sentencepiece'] = sys.modules['tiktoken'] = None; "
            "import meshlm.cli, meshlm.data.tokenizers_extra, meshlm.training.trainer, meshlm.validate")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# ----------------------------------------------------------------------------- TikTokenizer


@pytest.mark.parametrize("pattern", [None, "v1", "v2"])
@pytest.mark.parametrize("cut", [0, 40])
def test_tiktokenizer_matches_megatron_core(models, megatron_build, pattern, cut):
    _, path, entries = models
    vocab = NUM_SPECIAL + entries - cut  # a --vocab-size below the file's cuts its last merges
    cfg = tok_cfg("TikTokenizer", path, tiktoken_pattern=pattern)
    ours, theirs = build_tokenizer(cfg, vocab), megatron_build(megatron_cfg(cfg, vocab))
    assert ours.vocab_size == theirs.vocab_size == vocab
    assert (ours.eod, ours.bos) == (theirs.eod, theirs.bos) == (2, 1)  # </s>, <s> of the default specials
    assert ours.pad == theirs.pad == 4  # <pad>: its labels are left out of the loss (data/packing.py)
    for text in TEXTS + corpus(5, seed=1):
        ids = ours.encode(text)
        assert ids == theirs.tokenize(text)
        assert all(i >= NUM_SPECIAL or i in (1, 2) for i in ids) and max(ids, default=0) < vocab
        assert ours.decode(ids) == text
        if text.isascii():  # megatron-core 0.16.1 decodes token by token: exact for ASCII only
            assert theirs.detokenize(ids) == text
    assert 1 in ours.encode("a <s> b")  # special tokens in the text are encoded, as Megatron does
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    assert pickle.loads(pickle.dumps(ours)).encode(TEXTS[2]) == ours.encode(TEXTS[2])  # preprocess --workers
    assert len(ours.encode(" the quick fox")) == 3  # the merges are used


def test_split_patterns_are_megatrons():
    megatron = pytest.importorskip("megatron.core.tokenizers.text.libraries.tiktoken_tokenizer")
    assert TIKTOKEN_PATTERNS == {"v1": megatron._PATTERN_TIKTOKEN_V1, "v2": megatron._PATTERN_TIKTOKEN_V2}
    assert TIKTOKEN_SPECIAL_TOKENS == tuple(megatron.SPECIAL_TOKENS)


def test_tiktokenizer_special_token_flags(models, megatron_build):
    _, path, entries = models
    special = ["<pad>", "<s>", "</s>", "<unk>", "<mask>", "<cls>", "<sep>", "<|im_start|>"]
    cfg = tok_cfg("TikTokenizer", path, tokenizer_special_tokens=special, tiktoken_num_special_tokens=10)
    ours, theirs = build_tokenizer(cfg, 10 + entries), megatron_build(megatron_cfg(cfg, 10 + entries))
    assert (ours.eod, ours.bos) == (theirs.eod, theirs.bos) == (2, 1)
    text = "<|im_start|>the fox<SPECIAL_9>"
    assert ours.encode(text) == theirs.tokenize(text) and ours.encode(text)[0] == 7 and ours.encode(text)[-1] == 9
    assert ours.decode(ours.encode(text)) == text
    assert ours.identity != build_tokenizer(tok_cfg("TikTokenizer", path), NUM_SPECIAL + entries).identity


@pytest.mark.parametrize("kw,vocab,error,message", [
    (dict(tokenizer_special_tokens=["<s>", "</s>"]), None, ConfigError,
     r"^--tokenizer-special-tokens must include .*; add <unk> <mask> <pad> <cls> <sep>$"),
    (dict(tokenizer_special_tokens=["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<s>"]), None,
     ConfigError, r"^--tokenizer-special-tokens: <s> given twice"),
    (dict(tiktoken_num_special_tokens=5), None, ConfigError, r"^--tiktoken-num-special-tokens 5: needs at least the 7"),
    (dict(tiktoken_num_special_tokens=2000), 2000, ConfigError, r"fewer than --vocab-size 2000$"),
    ({}, None, DataError, r"tiktoken.json: holds \d+ tokens, fewer than the 130072 that --vocab-size less "
                          r"--tiktoken-num-special-tokens asks for; lower --vocab-size"),
])
def test_tiktokenizer_mistakes_are_one_line(models, kw, vocab, error, message):
    with pytest.raises(error, match=message):
        build_tokenizer(tok_cfg("TikTokenizer", models[1], **kw), vocab)


@pytest.mark.parametrize("entry,message", [
    (lambda v: v[3].update(rank=7), "entry 3 has rank 7; entry i must have rank i"),
    (lambda v: v[10].update(token_bytes=base64.b64encode(b"ab").decode()), "entry 10 must be the single byte 10"),
    (lambda v: v[300].update(token_bytes=v[299]["token_bytes"]), "entry 300 repeats the token of entry 299"),
    (lambda v: v[5].pop("token_str"), r"entry 5 is not \{"),
    (lambda v: v[6].update(token_bytes="not base64!"), "entry 6: token_bytes is not base64"),
])
def test_a_malformed_tiktoken_vocabulary_names_the_entry(models, tmp_path, entry, message):
    vocab = json.load(open(models[1]))
    entry(vocab)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(vocab))
    with pytest.raises(DataError, match=r"^--tokenizer-model \S+bad.json: " + message):
        build_tokenizer(tok_cfg("TikTokenizer", path), NUM_SPECIAL + len(vocab))


# ----------------------------------------------------------------------------- before workers start

BASE = ["pretrain", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--split", "1,0,0",
        "--nproc-per-node", "1", "--make-vocab-size-divisible-by", "64"]


@pytest.mark.parametrize("flags,message", [
    (["--tokenizer-type", "Llama2Tokenizer"], "--tokenizer-type Llama2Tokenizer needs --tokenizer-model "
                                              "(a SentencePiece .model)"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "nope.model"],
     "--tokenizer-model nope.model: no such file"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "tokenizer.json"],
     "--tokenizer-model tokenizer.json: not a SentencePiece model"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "SP"], "TikTokenizer reads Megatron's JSON vocabulary"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "TIK"], "fewer than the 130072"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "SP", "--tokenizer-special-tokens", "<x>"],
     "--tokenizer-special-tokens with --tokenizer-type SentencePieceTokenizer: Megatron takes them only under "
     "--tokenizer-sentencepiece-legacy"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "tokenizer.json", "--tokenizer-special-tokens",
      "<x>"], "--tokenizer-special-tokens is read only by --tokenizer-type TikTokenizer here; drop it for "
              "HuggingFaceTokenizer"),
])
def test_tokenizer_problems_are_found_before_any_worker_starts(models, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')  # only its name is read
    writer = IndexedDatasetWriter(str(tmp_path / "d_text_document"))  # a launch opens the .idx
    writer.add_document([0, 1])
    writer.finalize()
    flags = [models[0] if f == "SP" else models[1] if f == "TIK" else f for f in flags]
    data = ["--data-path", "d_text_document"]
    assert main(BASE + data + ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", models[0], "--dry-run"]) == 0
    capsys.readouterr()
    assert main(BASE + data + flags + ["--run-dir", "run"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # no worker started, nothing written


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer"])
def test_preprocess_pretrain_generate(models, tmp_path, monkeypatch, capsys, kind):
    monkeypatch.chdir(tmp_path)
    sp_model, tik_vocab, entries = models
    flags = ["--tokenizer-type", kind, "--tokenizer-model", tik_vocab if kind == "TikTokenizer" else sp_model]
    flags += ["--vocab-size", str(NUM_SPECIAL + entries), "--tiktoken-pattern", "v1"] if kind == "TikTokenizer" else []
    texts = corpus(60, seed=2)
    with open("corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    assert main(["preprocess", "--input", "corpus.jsonl", "--output-prefix", "data", "--append-eod", *flags]) == 0
    tok = build_tokenizer(tok_cfg(kind, flags[3], tiktoken_pattern="v1" if kind == "TikTokenizer" else None),
                          NUM_SPECIAL + entries if kind == "TikTokenizer" else None)
    docs = IndexedDataset("data_text_document")
    assert [docs[i].tolist() for i in range(len(texts))] == [tok.encode(t) + [tok.eod] for t in texts]

    out = subprocess.run([sys.executable, "-m", "meshlm", *BASE, *flags, "--data-path", "data_text_document",
                          "--run-dir", "run", "--save", "ckpt"], env=clean_env(PYTHONPATH=SRC), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    losses = [r["lm_loss"] for r in map(json.loads, open("run/logs/metrics.jsonl")) if "lm_loss" in r]
    assert len(losses) == 2

    from meshlm.training.generate import load_model
    model, loaded = load_model("ckpt")
    assert loaded.identity == tok.identity and model.vocab_size == tok.vocab_size
    assert model.padded_vocab == padded_vocab_size(tok.vocab_size, 64, 1) > tok.vocab_size  # padded as Megatron
    capsys.readouterr()
    assert main(["generate", "--load", "ckpt", "--prompt", "the quick", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the quick")
