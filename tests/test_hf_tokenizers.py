"""The tokenizer through `meshlm convert` (checkpoint/hf_tokenizer.py, data/sp_to_hf.py): a Hugging Face
folder holding a tokenizer.json, a SentencePiece tokenizer.model, or GPT-2's vocab.json + merges.txt
imports as HuggingFaceTokenizer / Llama2Tokenizer / GPT2BPETokenizer, and the export of that
checkpoint loads in ``transformers.AutoTokenizer`` giving, text by text, the ids of meshlm's
tokenizer (and config.json / generation_config.json carry its eos id). The tokenizers are trained
here (the repo's byte-level BPE trainer, SentencePiece on generated lines): no downloads."""

import json
import os

import pytest
import torch

from meshlm import config as C
from meshlm.checkpoint import convert
from meshlm.checkpoint.hf_tokenizer import export_tokenizer
from meshlm.cli import main
from meshlm.data.tokenizer import build_tokenizer, train_bpe
from meshlm.errors import DataError
from meshlm.training import generate
from test_tokenizers_sp_tiktoken import TEXTS, corpus

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROBES = TEXTS + corpus(10, seed=3) + [" ", "  lead and trail  ", "tab\tx\n\ny", "<|endoftext|> x", "<unk>"]


def _sp_model(path, **kw):
    """A SentencePiece model trained on generated lines; default: Llama's settings (BPE, byte
    fallback, no normalization, spaces kept)."""
    settings = dict(model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                    remove_extra_whitespaces=False)
    settings.update(kw)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(200) + ["naïve café Ελληνικά"]), model_prefix=str(path), vocab_size=400,
        hard_vocab_limit=False, minloglevel=2, **settings)
    return str(path) + ".model"


def _hf_folder(folder, arch, vocab):
    """A tiny random transformers model of ``arch`` with ``vocab`` rows, saved in ``folder``."""
    t = transformers
    torch.manual_seed(0)
    if arch == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 max_position_embeddings=32))
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: HF folder}: "hf" (tokenizer.json alone), "sp" (tokenizer.model, its tokenizer_config.json
    adding BOS as Llama's does), "gpt2" (vocab.json + merges.txt)."""
    tmp = tmp_path_factory.mktemp("tok")
    out = {}
    bpe = train_bpe(corpus(200), 300, str(tmp / "bpe.json"))
    out["hf"] = str(tmp / "hf")
    _hf_folder(out["hf"], "llama", bpe.vocab_size)
    os.replace(tmp / "bpe.json", os.path.join(out["hf"], "tokenizer.json"))
    out["gpt2"] = str(tmp / "gpt2")
    _hf_folder(out["gpt2"], "gpt2", bpe.vocab_size)
    bpe._tok.model.save(out["gpt2"])  # vocab.json, merges.txt
    out["sp"] = str(tmp / "sp")
    model = _sp_model(tmp / "sp_model")
    _hf_folder(out["sp"], "llama", sentencepiece.SentencePieceProcessor(model_file=model).get_piece_size())
    os.replace(model, os.path.join(out["sp"], "tokenizer.model"))
    with open(os.path.join(out["sp"], "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}, f)
    return out


@pytest.mark.parametrize("kind, meshlm_type, files", [
    ("hf", "HuggingFaceTokenizer", {"tokenizer.json", "tokenizer_config.json"}),
    ("sp", "Llama2Tokenizer", {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"}),
    ("gpt2", "GPT2BPETokenizer", {"vocab.json", "merges.txt", "tokenizer_config.json"}),
])
def test_tokenizer_travels_both_ways_with_the_same_ids(folders, tmp_path, capsys, kind, meshlm_type, files):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert main(["convert", "--from-hf", folders[kind], "--save", ckpt]) == 0
    noted = capsys.readouterr().out
    assert ("adds a BOS token; meshlm's Llama2Tokenizer does not" in noted) == (kind == "sp")
    saved = json.load(open(os.path.join(ckpt, "iter_0000000", "config.json")))["data"]
    assert saved["tokenizer_type"] == meshlm_type
    assert all(os.path.dirname(v) == os.path.abspath(ckpt) for k, v in saved.items()
               if k in ("tokenizer_model", "vocab_file", "merge_file") and v)  # copied into the checkpoint
    _, ours = generate.load_model(ckpt)
    assert main(["convert", "--to-hf", "--load", ckpt, "--output", out]) == 0
    assert files <= set(os.listdir(out))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in PROBES:
        assert theirs(text)["input_ids"] == ours.encode(text), (kind, text)
    assert len(ours.encode(" the quick brown fox")) < 15  # 20 characters: the merges are used
    assert theirs.eos_token_id == ours.eod
    for name in ("config.json", "generation_config.json"):
        assert json.load(open(os.path.join(out, name)))["eos_token_id"] == ours.eod, name
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == ours.eod


DEFAULTS = dict(byte_fallback=False, normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True)


@pytest.mark.parametrize("settings", [{}, dict(model_type="bpe", **DEFAULTS), dict(model_type="unigram", **DEFAULTS),
                                      dict(model_type="unigram")], ids=["llama", "bpe", "unigram", "unigram-bytes"])
def test_sentencepiece_models_convert_to_tokenizer_json_with_the_same_ids(tmp_path, settings):
    """Llama's settings, and SentencePiece's defaults (NFKC normalization, spaces squeezed). (A
    unigram model may match <s> written in the text, which SentencePiece never does: not probed.)"""
    from meshlm.data.sp_to_hf import to_tokenizers
    path = _sp_model(tmp_path / "m", **settings)
    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    tok = to_tokenizers(path)
    tok.encode_special_tokens = True
    texts = [t for t in PROBES if not any(s in t for s in ("<s>", "</s>", "<unk>"))] + ["ﬁne Ａ  x", "x  "]
    for text in texts:
        assert tok.encode(text).ids == sp.encode(text), text


def test_a_word_model_is_refused_with_a_note_and_tokenizer_model_is_still_written(tmp_path):
    path = _sp_model(tmp_path / "w", model_type="word", byte_fallback=False)
    from meshlm.data.sp_to_hf import to_tokenizers
    with pytest.raises(DataError, match=r"w.model: no tokenizer.json equivalent \(it is a word or character model\)"):
        to_tokenizers(path)
    data = C.DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=path)
    (tmp_path / "out").mkdir()
    files, notes, ids = export_tokenizer(data, str(tmp_path / "out"), build_tokenizer(data).vocab_size)
    assert files == ["tokenizer.model", "tokenizer_config.json"] and "LlamaTokenizer" in notes[0]
    assert ids["eos_token_id"] == build_tokenizer(data).eod


def test_null_and_tiktoken_are_not_exported_with_a_note(tmp_path, folders, capsys):
    import base64
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": chr(i)} for i in range(256)]
    (tmp_path / "tik.json").write_text(json.dumps(vocab))
    (tmp_path / "out").mkdir()
    tik = C.DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(tmp_path / "tik.json"))
    files, notes, ids = export_tokenizer(tik, str(tmp_path / "out"), 1256)
    assert files == [] and notes[0].startswith("TikTokenizer not exported: transformers has no reader")
    assert ids["eos_token_id"] == 2 and os.listdir(tmp_path / "out") == []  # </s> of the default specials
    # a folder without any tokenizer imports as NullTokenizer, and exports no tokenizer
    bare = tmp_path / "bare"
    _hf_folder(str(bare), "llama", 50)
    assert main(["convert", "--from-hf", str(bare), "--save", str(tmp_path / "ckpt")]) == 0
    assert "the checkpoint uses NullTokenizer" in capsys.readouterr().out
    assert main(["convert", "--to-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "o")]) == 0
    assert "no tokenizer exported: the run used NullTokenizer" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "o")) == ["config.json", "model.safetensors"]


def test_a_tokenizer_of_another_vocabulary_is_not_imported(folders, tmp_path, capsys):
    folder = tmp_path / "mismatch"
    _hf_folder(str(folder), "llama", 64)
    os.link(os.path.join(folders["sp"], "tokenizer.model"), folder / "tokenizer.model")
    assert convert.import_hf(str(folder), str(tmp_path / "ckpt"))
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).get_piece_size()
    assert f"has {pieces} tokens, the model 64 rows: the checkpoint uses NullTokenizer" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "ckpt" / "tokenizer.model")
