"""Faults a newcomer met moving models to and from Hugging Face (issue 28): a partial-rotary model
exported as a full-rotary one, and an HF model's dropout lost on the way in and out."""

from __future__ import annotations

import os

import pytest

from meshlm import config as C
from meshlm.checkpoint import convert
from meshlm.checkpoint.hf_config import hf_config_from_model, model_flags, model_from_hf
from meshlm.errors import CheckpointError

pytest.importorskip("safetensors")


def _llama(**changes) -> dict:
    hf = dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_dropout=0.0)
    hf.update(changes)
    return hf


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral"])
def test_to_hf_refuses_partial_rotary_that_the_architecture_lacks(arch):
    """transformers' llama, mistral and mixtral rotate every dimension of a head: a model trained
    with --rotary-percent 0.5 is refused in one line naming the flag, not written full-rotary."""
    m = model_from_hf(_llama(), "x").model_config()
    m.rotary_percent = 0.5
    if arch == "mixtral":
        m.num_experts = 2
    with pytest.raises(CheckpointError) as e:
        hf_config_from_model(m, 100, arch)
    assert "--rotary-percent 0.5" in str(e.value) and "needs 1.0" in str(e.value) and "\n" not in str(e.value)
    m.rotary_percent = 1.0
    assert hf_config_from_model(m, 100, arch)["model_type"] == arch


def test_hf_dropout_is_in_the_flags_hint_and_carried_by_a_load(tmp_path):
    """An HF model trained without dropout: the 'pass its flags' hint names --hidden-dropout and
    --attention-dropout, and a fine-tuning run from it (or from its converted checkpoint) that sets
    neither runs at the model's dropout (so its export says the same), while a flag still wins."""
    hf = model_from_hf(_llama(), "x")
    hint = model_flags(hf)
    assert "--hidden-dropout 0" in hint and "--attention-dropout 0" in hint
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(__import__("json").dumps(_llama(attention_dropout=0.05)))
    (folder / "model.safetensors").write_bytes(b"")  # is_hf_folder looks at names only
    cfg = C.Config()
    cfg.checkpoint.load = str(folder)
    notes = convert.carry_dropout(cfg, explicit={"attention_dropout"})
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.1)  # the flag given wins
    assert len(notes) == 1 and notes[0].startswith("--hidden-dropout 0:")
    cfg = C.Config()
    cfg.model = model_from_hf(_llama(), "x").model_config()
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1  # meshlm's defaults: no flag given
    cfg.checkpoint.load = str(folder)
    convert.carry_dropout(cfg, explicit=set())
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.05)
    assert hf_config_from_model(cfg.model, 100)["attention_dropout"] == 0.05
    cfg = C.Config()
    cfg.checkpoint.load = str(tmp_path / "missing")
    assert convert.carry_dropout(cfg, set()) == [] and cfg.model.hidden_dropout == 0.1
    assert not os.path.exists(tmp_path / "missing")


def test_a_hf_folder_used_as_save_too_resumes_from_its_checkpoints_at_their_dropout(tmp_path, capsys):
    """`pretrain --load HF --save HF` (the --load = --save restart pattern) saves meshlm checkpoints
    into the HF folder; its restart fine-tuned from the HF weights at iteration 0 again, and a
    resume without dropout flags ran at meshlm's default 0.1, not the 0 its first attempt took
    from the HF model: the restart was not the uninterrupted run."""
    import json
    import torch
    from meshlm.checkpoint import dist as ckpt
    from meshlm.cli import main
    from meshlm.validate import _load_problems
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama(attention_dropout=0.05)))
    (folder / "model.safetensors").write_bytes(b"")  # is_hf_folder looks at names only
    cfg = C.Config()
    cfg.checkpoint.load = cfg.checkpoint.save = str(folder)
    assert convert.is_weights_only(str(folder))  # no checkpoint yet: fine-tune the HF weights
    saved = C.Config()
    saved.model.hidden_dropout, saved.model.attention_dropout = 0.0, 0.05
    ckpt.save(str(folder), 2, {"model": {"w": torch.zeros(2)}, "optimizer": {"step": torch.zeros(1)}},
              config=saved.to_dict())
    assert not convert.is_weights_only(str(folder))  # its own checkpoints: a resume
    assert _load_problems(cfg) == []  # not checked as a HF model to fine-tune
    notes = convert.carry_dropout(cfg, explicit=set())
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.05) and len(notes) == 2
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(folder)]) == 0  # shows the checkpoint, not "a HF folder"
    assert "iter_0000002" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral"])
def test_fields_a_config_json_leaves_out_take_transformers_defaults(arch):
    """A config.json without rms_norm_eps, rope_theta, sliding_window or num_key_value_heads:
    meshlm took Llama's values for all three architectures (Mixtral's eps is 1e-5 and its theta
    1e6; Mistral's window 4096), so it computed another model than transformers builds from it."""
    transformers = pytest.importorskip("transformers")
    minimal = dict(model_type=arch, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=16,
                   vocab_size=100, **(dict(num_local_experts=4, num_experts_per_tok=2) if arch == "mixtral" else {}))
    theirs = transformers.AutoConfig.for_model(**minimal)
    ours = model_from_hf(minimal, "x")
    m = ours.model_config()
    theta = (theirs.rope_parameters or {}).get("rope_theta") or theirs.rope_theta
    assert (m.norm_epsilon, m.rotary_base, C.query_groups(m)) == (theirs.rms_norm_eps, theta, theirs.num_key_value_heads)
    assert (ours.max_positions, ours.window) == (theirs.max_position_embeddings, getattr(theirs, "sliding_window", None))


def _gpt2(**changes) -> dict:
    hf = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    hf.update(changes)
    return hf


@pytest.mark.parametrize("hf, field", [
    (_gpt2(n_layer="2"), "n_layer='2' is not a positive integer"),  # a TypeError traceback
    (_gpt2(n_layer=1.5), "n_layer=1.5 is not a positive integer"),
    (_gpt2(n_embd=True), "n_embd=True is not a positive integer"),
    (_gpt2(n_head=0), "n_head=0 is not a positive integer"),  # a ZeroDivisionError traceback
    (_gpt2(n_layer=0), "n_layer=0 is not a positive integer"),  # "holds 24 tensors … no place for"
    (_gpt2(layer_norm_epsilon=-1), "layer_norm_epsilon=-1 is not a number > 0"),  # converted silently
    (_gpt2(resid_pdrop=2), "resid_pdrop=2 is not in [0, 1)"),
    (_llama(rms_norm_eps="1e-6"), "rms_norm_eps='1e-6' is not a number > 0"),  # a ValueError traceback
    (_llama(num_attention_heads=0), "num_attention_heads=0 is not a positive integer"),
    (_llama(max_position_embeddings=-5), "max_position_embeddings=-5 is not a positive integer"),
    (_llama(rope_theta="big"), "rope_theta='big' is not a number > 0"),
    (_llama(rope_scaling="linear"), "rope_scaling='linear' is not supported"),  # an AttributeError traceback
])
def test_a_config_json_field_of_the_wrong_kind_or_range_is_one_line_naming_it(hf, field):
    with pytest.raises(CheckpointError) as e:
        model_from_hf(hf, "hf/config.json")
    assert str(e.value).startswith(f"hf/config.json: {field}") and "\n" not in str(e.value)
    assert model_from_hf(_gpt2(n_layer=2.0, n_inner=None), "x").model["num_layers"] == 2  # JSON 2.0: an integer


@pytest.mark.parametrize("changes,arch,fix", [
    ({}, "llama", "leave --hf-architecture out (this model exports as gpt2)"),  # a GPT-2 model asked for llama
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True), "gpt2",
     "leave --hf-architecture out (this model exports as llama)"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False), "qwen3",
     "leave --hf-architecture out (this model exports as llama)"),
    (dict(position_embedding_type="rope"), None,  # RoPE with LayerNorm: no architecture has both
     "none of the architectures meshlm exports (llama, mistral, mixtral, qwen2, qwen3, gpt2) can express this model")])
def test_to_hf_of_a_model_the_architecture_cannot_express_names_the_way_out(changes, arch, fix):
    """`convert --to-hf --hf-architecture llama` of a GPT-2 model ended "… a Hugging Face llama model needs
    rope": no word that the flag was the cause, nor which --hf-architecture exports the model."""
    with pytest.raises(CheckpointError) as e:
        hf_config_from_model(C.ModelConfig(**changes), 128, arch)
    assert str(e.value).endswith(f"; {fix}") and "\n" not in str(e.value)
