"""Config: validation reports every problem at once, naming the flags; YAML and flag precedence;
model presets."""

import argparse
import glob
import os
import re

import pytest
import torch

from meshlm.config import (Config, add_config_args, config_from_args, dump_yaml, head_dim,
                           moe_ffn, moe_layer_pattern, query_groups)
from meshlm.errors import ConfigError
from meshlm.presets import PRESETS, apply_preset
from meshlm.validate import notes, validate


def small() -> Config:
    """A valid config: tiny GPT on mock data, 1 process."""
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2, 32, 4
    cfg.model.seq_length, cfg.model.vocab_size = 16, 128
    cfg.data.mock_data = True
    return cfg


def problems_of(cfg, world=1, check_files=True) -> list:
    with pytest.raises(ConfigError) as info:
        validate(cfg, world, check_files=check_files)
    return info.value.problems


def test_small_config_is_valid():
    validate(small(), world=1)


# ----------------------------------------------------------------------------- one problem each

def test_global_batch_not_divisible_names_both_flags_and_nearest_valid_values():
    cfg = small()
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 7, 2
    [msg] = problems_of(cfg, world=2)  # DP = 2: valid global batches are multiples of 4
    assert "--global-batch-size 7" in msg and "--micro-batch-size 2" in msg and "DP 2" in msg
    assert "4 or 8" in msg


@pytest.mark.parametrize("fields, expected", [
    (dict(recompute_method="block"), ["--recompute-method block needs --recompute-granularity full"]),
    (dict(recompute_num_layers=1), ["--recompute-num-layers 1 needs --recompute-granularity full"]),
    (dict(recompute_granularity="full", recompute_num_layers=1),
     ["--recompute-granularity full needs --recompute-method uniform or block"]),
    (dict(recompute_granularity="full", recompute_method="uniform"),
     ["--recompute-granularity full needs --recompute-num-layers N"]),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
     ["--recompute-num-layers 3 exceeds --num-layers 2; give 1..2"]),
    (dict(recompute_activations=True, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), ["--recompute-activations means --recompute-granularity selective; "
                                    "drop it to recompute full layers"]),
])
def test_recompute_flags_follow_megatron_rules(fields, expected):
    cfg = small()
    for name, value in fields.items():
        setattr(cfg.training, name, value)
    assert problems_of(cfg) == expected


def test_recompute_settings_megatron_accepts_are_valid():
    for fields in (dict(recompute_activations=True), dict(recompute_granularity="selective"),
                   dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)):
        cfg = small()
        for name, value in fields.items():
            setattr(cfg.training, name, value)
        validate(cfg, world=1)


def test_global_batch_below_one_step_suggests_the_smallest_valid_value():
    cfg = small()
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 3, 4
    [msg] = problems_of(cfg, world=1)
    assert msg.endswith(": 4")


def test_heads_not_divisible_by_tp():
    cfg = small()
    cfg.model.num_attention_heads, cfg.model.hidden_size = 6, 48
    cfg.parallel.tensor_model_parallel_size = 4
    [msg] = problems_of(cfg, world=4)
    assert "--num-attention-heads 6" in msg and "--tensor-model-parallel-size 4" in msg


def test_layers_not_divisible_by_pp():
    cfg = small()
    cfg.model.num_layers = 3
    cfg.parallel.pipeline_model_parallel_size = 2
    msgs = problems_of(cfg, world=2)
    assert any("--num-layers 3" in m and "--pipeline-model-parallel-size 2" in m for m in msgs)


def test_query_groups_must_divide_heads():
    cfg = small()
    cfg.model.group_query_attention, cfg.model.num_query_groups = True, 3
    [msg] = problems_of(cfg)
    assert "--num-query-groups 3" in msg and "--num-attention-heads 4" in msg


def test_query_groups_must_split_over_tp():
    cfg = small()
    cfg.model.num_attention_heads, cfg.model.hidden_size = 12, 48
    cfg.model.group_query_attention, cfg.model.num_query_groups = True, 6
    cfg.parallel.tensor_model_parallel_size = 4
    [msg] = problems_of(cfg, world=4)
    assert "--num-query-groups 6" in msg and "--tensor-model-parallel-size 4" in msg


def test_gqa_flag_without_group_count_is_multi_query_as_in_megatron():
    """Megatron's --num-query-groups defaults to 1: a script with --group-query-attention alone runs
    multi-query attention there, so it must run here too (it was refused)."""
    cfg = small()
    cfg.model.group_query_attention = True
    validate(cfg, 1)
    assert query_groups(cfg.model) == 1


def test_missing_data_files_name_the_file(tmp_path):
    cfg = small()
    cfg.data.mock_data = False
    cfg.data.data_path = [str(tmp_path / "corpus_text_document")]
    cfg.data.tokenizer_type = "NullTokenizer"
    msgs = problems_of(cfg)
    assert [m for m in msgs if "corpus_text_document" in m] == [
        f"--data-path: {tmp_path / 'corpus_text_document.bin'} does not exist (run `meshlm preprocess` to make it)"]
    (tmp_path / "corpus_text_document.bin").write_bytes(b"")
    assert any("corpus_text_document.idx does not exist" in m for m in problems_of(cfg))


def test_no_data_source_at_all():
    cfg = small()
    cfg.data.mock_data = False
    [msg] = problems_of(cfg)
    assert "--data-path" in msg and "--mock-data" in msg


def test_missing_tokenizer_file(tmp_path):
    cfg = small()
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = "HuggingFaceTokenizer", str(tmp_path / "tok.json")
    [msg] = problems_of(cfg)
    assert "--tokenizer-model" in msg and "tok.json" in msg


def test_file_checks_can_be_left_out(tmp_path):
    cfg = small()
    cfg.data.mock_data = False
    validate(cfg, world=1, check_files=False)


def test_sequence_longer_than_max_positions():
    cfg = small()
    cfg.model.seq_length, cfg.model.max_position_embeddings = 64, 32
    [msg] = problems_of(cfg)
    assert "--seq-length 64" in msg and "--max-position-embeddings 32" in msg


def test_rope_has_no_position_table_limit():
    cfg = small()
    cfg.model.position_embedding_type = "rope"
    cfg.model.seq_length, cfg.model.max_position_embeddings = 64, 32
    validate(cfg, world=1)


def test_mock_data_needs_vocab_size():
    cfg = small()
    cfg.model.vocab_size = None
    [msg] = problems_of(cfg)
    assert "--mock-data" in msg and "--vocab-size" in msg


def test_fp16_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = small()
    cfg.training.fp16 = True
    [msg] = problems_of(cfg)
    assert "--fp16" in msg and "CUDA" in msg and "--bf16" in msg


def test_bf16_is_allowed_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = small()
    cfg.training.bf16 = True
    validate(cfg, world=1)


def test_bf16_and_fp16_are_exclusive(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = small()
    cfg.training.bf16 = cfg.training.fp16 = True
    [msg] = problems_of(cfg)
    assert "--bf16" in msg and "--fp16" in msg


def test_save_interval_needs_save():
    cfg = small()
    cfg.checkpoint.save_interval = 10
    [msg] = problems_of(cfg)
    assert "--save-interval 10" in msg and "--save" in msg


def test_save_interval_with_save_is_fine(tmp_path):
    cfg = small()
    cfg.checkpoint.save_interval, cfg.checkpoint.save = 10, str(tmp_path / "ckpt")
    validate(cfg, world=1)


def test_eval_iters_zero_is_fine_but_negative_is_not():
    cfg = small()
    cfg.training.eval_iters = 0
    validate(cfg, world=1)
    cfg.training.eval_iters = -1
    [msg] = problems_of(cfg)
    assert "--eval-iters" in msg


def test_negative_learning_rate():
    cfg = small()
    cfg.optimizer.lr = -1e-3
    [msg] = problems_of(cfg)
    assert "--lr -0.001" in msg


def test_min_lr_above_lr():
    cfg = small()
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-4, 1e-3
    [msg] = problems_of(cfg)
    assert "--min-lr" in msg and "--lr" in msg


def test_warmup_longer_than_decay():
    cfg = small()
    cfg.training.train_iters, cfg.optimizer.lr_warmup_iters = 5, 10
    [msg] = problems_of(cfg)
    assert "--lr-warmup-iters 10" in msg and "--train-iters" in msg


@pytest.mark.parametrize("split", ["1,2,3,4", "a,b,c", "0,0,0", "-1,1,1", ""])
def test_bad_split(split):
    cfg = small()
    cfg.data.split = split
    [msg] = problems_of(cfg)
    assert "--split" in msg


@pytest.mark.parametrize("split", ["969,30,1", "98/2/0", "969,30", "1"])
def test_good_split(split):
    cfg = small()
    cfg.data.split = split
    validate(cfg, world=1)


def test_world_not_divisible_by_model_parallel_size():
    cfg = small()
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.parallel.pipeline_model_parallel_size = 2
    msgs = problems_of(cfg, world=6)
    assert any("world size 6" in m and "--nproc-per-node" in m and "multiple of 4" in m for m in msgs)


def test_sequence_parallel_at_tp_1_is_turned_off_with_a_note_as_megatron_does():
    cfg = small()
    cfg.parallel.sequence_parallel = True
    assert any("--sequence-parallel is turned off" in line for line in notes(cfg))
    validate(cfg, world=1, check_files=False)
    assert cfg.parallel.sequence_parallel is False


def test_virtual_pipeline_rules_come_from_the_pipeline_module():
    cfg = small()
    cfg.parallel.virtual_pipeline_model_parallel_size = 2  # needs PP > 1
    msgs = problems_of(cfg)
    assert any("--virtual-pipeline-model-parallel-size" in m for m in msgs)


@pytest.mark.parametrize("flag,field", [("--micro-batch-size", ("training", "micro_batch_size")),
                                        ("--num-layers", ("model", "num_layers")),
                                        ("--tensor-model-parallel-size",
                                         ("parallel", "tensor_model_parallel_size"))])
def test_sizes_must_be_positive(flag, field):
    cfg = small()
    setattr(getattr(cfg, field[0]), field[1], 0)
    [msg] = problems_of(cfg)
    assert flag in msg and "positive" in msg


# ----------------------------------------------------------------------------- numeric domains

@pytest.mark.parametrize("section,name,value,flag", [
    ("optimizer", "clip_grad", float("nan"), "--clip-grad nan"),       # NaN would switch clipping off
    ("optimizer", "lr", float("inf"), "--lr inf"),
    ("training", "seed", -1, "--seed -1"),
    ("training", "seed", 2 ** 32, "--seed 4294967296"),
    ("model", "init_method_std", float("nan"), "--init-method-std nan"),
    ("model", "init_method_std", 0.0, "--init-method-std 0.0"),
    ("model", "norm_epsilon", -1e-5, "--norm-epsilon -1e-05"),
    ("parallel", "distributed_timeout_minutes", -1, "--distributed-timeout-minutes -1"),
    ("model", "hidden_dropout", 1.0, "--hidden-dropout 1.0"),
    ("optimizer", "adam_eps", 0.0, "--adam-eps 0.0"),
])
def test_a_numeric_flag_outside_its_domain_is_one_line_naming_it(section, name, value, flag):
    cfg = small()
    setattr(getattr(cfg, section), name, value)
    [msg] = problems_of(cfg)
    assert msg.startswith(flag + " is out of range: give ")


def test_every_numeric_flag_rejects_nan_and_negative_values():
    """The domain check is one rule over all int/float fields, not a list of names."""
    from meshlm.config import config_fields, flag_of
    from meshlm.values import kind_of
    for section, f in config_fields():
        if kind_of(f) not in ("int", "float"):  # a list of integers (--rampup-batch-size) has its own check
            continue
        if f.name == "null_tokenizer_pad_id":  # -1 is Megatron-LM's "no pad"; -2 is refused (test_data_tokenizer)
            continue
        for bad in ([float("nan"), float("-inf"), -1.0] if kind_of(f) == "float" else [-1]):
            cfg = small()
            setattr(getattr(cfg, section), f.name, bad)
            with pytest.raises(ConfigError) as info:
                validate(cfg, 1, check_files=False)
            assert any(p.startswith(f"{flag_of(f)} {bad} ") for p in info.value.problems), (f.name, bad)


def test_numeric_problems_are_reported_with_the_layout_problems():
    cfg = small()
    cfg.optimizer.clip_grad, cfg.training.seed = float("nan"), -5
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 7, 2
    text = str(pytest.raises(ConfigError, validate, cfg, 2).value)
    assert "--clip-grad nan" in text and "--seed -5" in text and "--global-batch-size 7" in text


@pytest.mark.parametrize("split", ["0,1,0", "0,0,1"])
def test_split_without_a_training_share_is_refused(split):
    cfg = small()
    cfg.data.split = split
    [msg] = problems_of(cfg)
    assert msg.startswith(f"--split {split} gives the training set no data")


@pytest.mark.parametrize("split", ["nan,1,1", "inf,1,0", "1,nan"])
def test_split_weights_must_be_finite(split):
    cfg = small()
    cfg.data.split = split
    [msg] = problems_of(cfg)
    assert "--split" in msg and "finite" in msg


def test_split_weights_near_the_float_maximum_are_halves_not_a_refused_training_share():
    """`--split 1e308,1e308,0` summed to inf: every weight became 0 (a numpy overflow warning) and the
    run was told its positive train weight was no data."""
    import warnings

    from meshlm.data.gpt_dataset import split_weights
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_weights("1e308,1e308,0") == [0.5, 0.5, 0.0]


# ----------------------------------------------------------------------------- splits over TP

def tp4() -> Config:
    cfg = small()
    cfg.parallel.tensor_model_parallel_size = 4
    return cfg


def test_mlp_width_must_split_over_tp():
    cfg = tp4()
    cfg.model.ffn_hidden_size = 30
    [msg] = problems_of(cfg, world=4)
    assert msg.startswith("--ffn-hidden-size 30 is not divisible by --tensor-model-parallel-size 4")
    assert "28 or 32" in msg


def test_seq_length_must_split_over_tp_under_sequence_parallel():
    cfg = tp4()
    cfg.parallel.sequence_parallel, cfg.model.seq_length = True, 18
    [msg] = problems_of(cfg, world=4)
    assert "--seq-length 18" in msg and "--sequence-parallel" in msg and "16 or 20" in msg


def test_fused_kv_rows_must_split_over_tp_when_groups_are_fewer_than_tp():
    cfg = tp4()
    cfg.model.group_query_attention = True
    cfg.model.num_query_groups, cfg.model.kv_channels = 1, 3  # 2 × 1 × 3 = 6 rows over 4 ranks
    [msg] = problems_of(cfg, world=4)
    assert "--num-query-groups 1" in msg and "head dim 3" in msg and "--kv-channels" in msg


def test_tp_split_problems_come_with_the_others_before_any_worker():
    cfg = tp4()
    cfg.model.ffn_hidden_size, cfg.parallel.sequence_parallel, cfg.model.seq_length = 30, True, 18
    cfg.optimizer.lr = -1.0
    problems = problems_of(cfg, world=4)
    assert len(problems) == 3
    assert {p.split()[0] for p in problems} == {"--ffn-hidden-size", "--seq-length", "--lr"}


# ----------------------------------------------------------------------------- folders the run writes

def test_save_that_is_a_file_is_refused(tmp_path):
    cfg = small()
    (tmp_path / "ckpt").write_text("")
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    [msg] = problems_of(cfg)
    assert msg == f"--save {tmp_path / 'ckpt'} is a file, not a directory; give a directory path " \
                  f"(it is created if missing)"


def test_save_under_a_file_is_refused(tmp_path):
    cfg = small()
    (tmp_path / "f").write_text("")
    cfg.checkpoint.save = str(tmp_path / "f" / "a" / "ckpt")
    [msg] = problems_of(cfg)
    assert msg.startswith(f"--save {cfg.checkpoint.save} cannot be created: {tmp_path / 'f'} is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_save_in_an_unwritable_folder_is_refused(tmp_path):
    cfg = small()
    (tmp_path / "ro").mkdir(mode=0o555)
    cfg.checkpoint.save = str(tmp_path / "ro" / "ckpt")
    [msg] = problems_of(cfg)
    assert "--save" in msg and "not writable" in msg


def test_run_dir_that_is_a_file_is_refused_even_without_file_checks(tmp_path):
    cfg = small()
    (tmp_path / "run").write_text("")
    cfg.logging.run_dir = str(tmp_path / "run")
    [msg] = problems_of(cfg, check_files=False)
    assert msg.startswith(f"--run-dir {tmp_path / 'run'} is a file")


def test_several_problems_are_reported_together():
    cfg = small()
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 7, 2
    cfg.model.num_attention_heads = 3                    # heads vs TP, hidden vs heads
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.checkpoint.save_interval = 5
    cfg.model.vocab_size = None
    with pytest.raises(ConfigError) as info:
        validate(cfg, world=4)
    text = str(info.value)
    for flag in ["--global-batch-size", "--num-attention-heads 3", "--hidden-size", "--save-interval",
                 "--vocab-size"]:
        assert flag in text
    assert len(info.value.problems) >= 5 and text.startswith(f"{len(info.value.problems)} config errors")


# ----------------------------------------------------------------------------- YAML and flags

def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return config_from_args(parser.parse_args(argv))


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_flat_keys_in_either_spelling(tmp_path):
    cfg = parse(["--config", write(tmp_path, "num_layers: 3\nhidden-size: 96\ndisable_bias_linear: true\n")])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.add_bias_linear) == (3, 96, False)


def test_yaml_nested_by_section(tmp_path):
    cfg = parse(["--config", write(tmp_path, "model:\n  num_layers: 3\ntraining:\n  micro_batch_size: 2\n"
                                             "data:\n  data_path: [0.5, a, 0.5, b]\n")])
    assert cfg.model.num_layers == 3 and cfg.training.micro_batch_size == 2
    assert cfg.data.data_path == ["0.5", "a", "0.5", "b"]


def test_yaml_unknown_key_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'num_layer'"):
        parse(["--config", write(tmp_path, "num_layer: 3\n")])


def test_yaml_several_unknown_keys_are_all_reported_as_unknown(tmp_path):
    path = write(tmp_path, "training:\n  micro_batch_sise: 4\n  bar: 2\nbaz: 1\n")
    with pytest.raises(ConfigError) as e:
        parse(["--config", path])
    assert e.value.problems == [f"{path}: unknown keys 'micro_batch_sise', 'bar', 'baz'"]


@pytest.mark.parametrize("text,key", [("num_layers: three\n", "num-layers"), ("swiglu: maybe\n", "swiglu"),
                                      ("normalization: BatchNorm\n", "normalization"),
                                      ("hidden_size: 2.5\n", "hidden-size")])
def test_yaml_bad_value_is_an_error_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key):
        parse(["--config", write(tmp_path, text)])


def test_yaml_missing_file_and_bad_syntax(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse(["--config", str(tmp_path / "absent.yaml")])
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse(["--config", write(tmp_path, "model: [\n")])


def test_precedence_preset_then_yaml_then_flags(tmp_path):
    path = write(tmp_path, "model: gpt2-125m\nnum_layers: 6\nhidden_size: 512\n")
    cfg = parse(["--config", path, "--hidden-size", "256"])
    gpt2 = PRESETS["gpt2-125m"]
    assert cfg.model_preset == "gpt2-125m"
    assert cfg.model.num_attention_heads == gpt2["num_attention_heads"]  # from the preset
    assert cfg.model.num_layers == 6                                      # YAML over preset
    assert cfg.model.hidden_size == 256                                   # flag over YAML


@pytest.mark.parametrize("flags, source", [(["--mock-data"], "--mock-data"), (["--data-path", "B"], "--data-path"),
                                           (["--train-data-path", "B"], "--train-data-path")])
def test_a_data_source_flag_replaces_the_yamls_source(tmp_path, flags, source):
    """Flags win, says the README; a YAML with data_path and --mock-data on the command line was
    refused ("--mock-data and --data-path are exclusive"), and a per-split flag met the YAML's --split."""
    from meshlm.data.sources import given_sources, source_problems
    cfg = parse(["--config", write(tmp_path, "data_path: [A]\nsplit: 98,2,0\n"), *flags])
    assert given_sources(cfg.data)[0].startswith(source) and source_problems(cfg.data) == []
    assert cfg.data.data_path == (["B"] if source == "--data-path" else [])


def test_a_run_length_flag_replaces_the_yamls_and_a_per_split_flag_keeps_the_other_splits(tmp_path):
    yaml = write(tmp_path, "train_iters: 100\nlr_warmup_iters: 10\nlr_decay_iters: 100\n"
                           "train_data_path: [A]\nvalid_data_path: [V]\n")
    cfg = parse(["--config", yaml, "--train-samples", "400", "--lr-warmup-samples", "20", "--train-data-path", "B"])
    t, o = cfg.training, cfg.optimizer
    assert (t.train_iters, t.train_samples, o.lr_warmup_iters, o.lr_warmup_samples) == (None, 400, 0, 20)
    assert o.lr_decay_iters == 100  # no decay flag given: the YAML's stays (and is refused with samples)
    assert (cfg.data.train_data_path, cfg.data.valid_data_path) == (["B"], ["V"])


def test_model_flag_preset_is_overridden_by_flags():
    cfg = parse(["--model", "llama3-8b", "--num-layers", "2"])
    assert cfg.model.num_layers == 2 and cfg.model.swiglu and cfg.model.num_query_groups == 8


def test_base_mapping_sits_below_flags():
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(["--lr", "0.01"]), base={"lr": 0.5, "train_iters": 7})
    assert cfg.optimizer.lr == 0.01 and cfg.training.train_iters == 7


def test_bool_flag_without_switch_parses_true_and_false():
    assert parse(["--use-cpu-initialization"]).parallel.use_cpu_initialization is True


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = parse(["--model", "llama-1b", "--num-layers", "2", "--mock-data", "--vocab-size", "300",
                 "--data-path", "0.3", "a", "0.7", "b"])
    path = str(tmp_path / "config.yaml")
    dump_yaml(cfg, path)
    again = parse(["--config", path])
    assert again == cfg


# ----------------------------------------------------------------------------- presets

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_config(name):
    cfg = Config()
    apply_preset(cfg, name)
    cfg.data.mock_data, cfg.model.vocab_size = True, 32000
    validate(cfg, world=1)
    assert cfg.model_preset == name


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError) as info:
        apply_preset(Config(), "gpt5")
    assert "--model 'gpt5'" in str(info.value) and "llama3-8b" in str(info.value)


def test_preset_shapes_match_the_published_models():
    cfg = Config()
    apply_preset(cfg, "llama-1b")  # Llama-3.2-1B
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, query_groups(m), m.ffn_hidden_size) == \
        (16, 2048, 32, 8, 8192)
    assert head_dim(m) == 64 and m.rotary_base == 500000.0 and m.normalization == "RMSNorm"
    assert m.swiglu and not m.add_bias_linear and not m.untie_embeddings_and_output_weights
    apply_preset(cfg, "gpt2-125m")  # over the Llama shape: nothing of it may remain
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (12, 768, 12, 1024)
    assert m.position_embedding_type == "learned_absolute" and m.normalization == "LayerNorm"
    assert not m.swiglu and m.add_bias_linear and query_groups(m) == 12 and m.ffn_hidden_size is None
    apply_preset(cfg, "mixtral-8x7b")  # Mixtral-8x7B-v0.1: the Mistral-7B block, 8 experts, top-2
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, query_groups(m), moe_ffn(m)) == \
        (32, 4096, 32, 8, 14336)
    assert (m.num_experts, m.moe_router_topk, m.rotary_base, m.moe_router_score_function) == (8, 2, 1e6, "softmax")
    assert all(moe_layer_pattern(m))
    apply_preset(cfg, "llama2-7b")
    assert cfg.model.num_experts is None and cfg.model.moe_aux_loss_coeff == 0.0


# ----------------------------------------------------------------------------- examples

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.yaml")))


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_configs_are_valid_for_the_world_they_state(path):
    world = int(re.search(r"^# world: (\d+)$", open(path).read(), re.M).group(1))
    validate(parse(["--config", path]), world, check_files=False)


def test_there_are_examples():
    assert len(EXAMPLES) >= 3


def test_context_parallel_needs_attention_dropout_0():
    """--context-parallel-size 2 trains (tests/test_context_parallel.py); with the default attention
    dropout it is refused naming the fix, and with --attention-dropout 0 it validates."""
    from meshlm.config import Config
    from meshlm.validate import validate
    from meshlm.errors import ConfigError
    cfg = Config()
    cfg.data.mock_data, cfg.model.vocab_size = True, 128
    cfg.parallel.context_parallel_size = 2
    with pytest.raises(ConfigError, match="set --attention-dropout 0 with --context-parallel-size 2"):
        validate(cfg, world=2)
    cfg.model.attention_dropout = 0.0
    validate(cfg, world=2)


def test_files_of_an_unused_tokenizer_are_not_required(tmp_path):
    """A YAML naming GPT-2 vocab/merges, switched to a HuggingFace tokenizer by flags, validates."""
    from meshlm.config import Config
    from meshlm.validate import validate
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    cfg = Config()
    cfg.data.mock_data, cfg.model.vocab_size = True, 128
    cfg.data.vocab_file, cfg.data.merge_file = "gpt2-vocab.json", "gpt2-merges.txt"  # absent
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = "HuggingFaceTokenizer", str(tok)
    validate(cfg, world=1)
    cfg.data.tokenizer_type = "GPT2BPETokenizer"  # now they are read: both named
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=1)
    assert "--vocab-file gpt2-vocab.json" in str(e.value) and "--merge-file gpt2-merges.txt" in str(e.value)


# ----------------------------------------------------------------------------- review fixes

@pytest.mark.parametrize("make, reason", [
    (lambda p: p.write_bytes(b"\xff\xfe garbage"), "is not UTF-8 text (byte 0xff at offset 0)"),
    (lambda p: p.mkdir(), "is a directory; give a YAML file"),
    (lambda p: (p.write_text("num_layers: 2\n"), p.chmod(0)), "cannot be read (Permission denied)"),
])
def test_an_unreadable_config_is_one_line_naming_it(tmp_path, make, reason):
    path = tmp_path / "b.yaml"
    make(path)
    if reason.startswith("cannot be read") and os.access(path, os.R_OK):
        pytest.skip("root reads any file")
    with pytest.raises(ConfigError) as info:
        parse(["--config", str(path)])
    assert str(info.value).startswith(f"--config {path} {reason}")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("train_iters: true\n", "train-iters=True is not an integer"),
    ("global_batch_size: 1e3\n", "global-batch-size='1e3' is not an integer (write 1000)"),
    ("lr: yes\n", "lr=True is not a number"),
    ("save: [a, b]\n", "save=['a', 'b'] is not text"),
    ("split: [98, 2, 0]\n", "split=[98, 2, 0] is not text (write the flag's text: '98,2,0')"),
    ("swiglu: 2\n", "swiglu=2 is not true or false"),
])
def test_a_yaml_value_of_the_wrong_kind_is_named_in_words(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        parse(["--config", write(tmp_path, text)])
    assert str(info.value) == f"{tmp_path / 'cfg.yaml'}: {message}"
    assert "Optional" not in str(info.value) and "int]" not in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("model:\n  num_layers: 2\nmodel:\n  hidden_size: 64\n", "line 3: key 'model' appears twice (first on line 1)"),
    ("lr: 0.1\nseed: 3\nlr: 0.2\n", "line 3: key 'lr' appears twice (first on line 1)"),
    ("model:\n  lr: 1\n  lr: 2\n", "line 3: key 'lr' appears twice (first on line 2)"),
])
def test_a_key_twice_in_a_yaml_mapping_is_refused_with_its_lines(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        parse(["--config", write(tmp_path, text)])
    assert str(info.value) == f"--config {tmp_path / 'cfg.yaml'}: {message}; keep one"


@pytest.mark.parametrize("text, message", [
    ("num_layers: 3\nmodel:\n  num_layers: 2\n", "'num_layers' is given twice (flat and in its section)"),
    ("num_layers: 3\nnum-layers: 2\n", "'num-layers' is given twice (also as 'num_layers')"),
])
def test_one_field_set_twice_in_two_places_is_refused(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        parse(["--config", write(tmp_path, text)])
    assert str(info.value) == f"{tmp_path / 'cfg.yaml'}: {message}; keep one"


def test_all_zero_split_says_so():
    cfg = small()
    cfg.data.split = "0,0,0"
    [msg] = problems_of(cfg)
    assert msg == ("--split '0,0,0' gives every split weight 0, so the training set gets no data; "
                   "make the first (train) weight positive, e.g. 969,30,1")


def test_a_quoted_or_space_separated_split_reads_as_its_numbers():
    """Megatron's Llama 3 8B FP8 example passes --split with its quotes ('99,1,0'); Megatron reads the
    numbers in it."""
    from meshlm.data.gpt_dataset import split_weights
    for text in ("'99,1,0'", '"99,1,0"', "99 1 0", " 99/1/0 "):
        assert split_weights(text) == split_weights("99,1,0"), text


@pytest.mark.parametrize("split, words", [("1,2,3,4", "has 4 weights"), ("a,b", "is not a list of numbers"),
                                          ("-1,1,1", "negative or non-finite")])
def test_each_bad_split_says_what_is_wrong(split, words):
    cfg = small()
    cfg.data.split = split
    [msg] = problems_of(cfg)
    assert words in msg


def test_a_process_count_that_would_swamp_the_node_is_refused_in_one_line(monkeypatch):
    """--nproc-per-node 100000 (or --num-workers 100000) forked that many processes on a 2-core machine."""
    from meshlm.parallel import mesh
    monkeypatch.setattr(mesh, "usable_cores", lambda: 2)
    cfg = small()
    cfg.parallel.nproc_per_node, cfg.data.num_workers = 16, 3  # 64 processes: 32 a core, allowed
    validate(cfg, world=16)
    for nproc, loaders in ((100000, 2), (1, 100000), (17, 3)):
        cfg.parallel.nproc_per_node, cfg.data.num_workers = nproc, loaders
        [line] = [m for m in problems_of(cfg, world=nproc) if "processes on this node" in m]
        assert line == (f"--nproc-per-node {nproc} × (1 + --num-workers {loaders}) = {nproc * (1 + loaders):,} "
                        f"processes on this node's 2 usable cores; meshlm starts at most 64 (32 a core): lower "
                        f"--nproc-per-node or --num-workers")


def test_under_torchrun_a_different_nproc_per_node_is_refused_not_ignored(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = small()
    cfg.parallel.nproc_per_node = 2  # torchrun's own figure: allowed
    validate(cfg, world=2)
    cfg.parallel.nproc_per_node = 4
    assert ("--nproc-per-node 4 is meshlm's own launcher's, but torchrun started this job with 2 processes on "
            "this node; drop it (torchrun's --nproc-per-node sizes the job)") in problems_of(cfg, world=2)


def test_fp8_with_experts_says_at_start_that_the_experts_measured_slower_than_bf16():
    cfg = small()
    cfg.training.fp8_format = "hybrid"
    assert not notes(cfg)
    cfg.model.num_experts = 4
    assert ["0.57x bf16's tokens/s for mixtral-small" in line for line in notes(cfg)] == [True]


def test_num_query_groups_without_gqa_is_ignored_as_in_megatron():
    cfg = small()
    cfg.model.num_query_groups = 2
    assert query_groups(cfg.model) == cfg.model.num_attention_heads
    cfg.parallel.tensor_model_parallel_size = 4  # groups 2 < TP 4 would need GQA's rules; not applied
    cfg.model.num_attention_heads = 4
    validate(cfg, world=4)
    assert notes(cfg) and "ignored without --group-query-attention" in notes(cfg)[0]
    cfg.model.group_query_attention = True
    assert query_groups(cfg.model) == 2 and not notes(cfg)


@pytest.mark.parametrize("flag, field", [("--save", ("checkpoint", "save")), ("--run-dir", ("logging", "run_dir")),
                                         ("--log-dir", ("logging", "log_dir")),
                                         ("--tensorboard-dir", ("logging", "tensorboard_dir")),
                                         ("--data-cache-path", ("data", "data_cache_path"))])
def test_an_output_folder_the_os_refuses_is_one_line_with_the_os_reason(flag, field):
    cfg = small()
    setattr(getattr(cfg, field[0]), field[1], "/proc/meshlm-test/x")
    [msg] = problems_of(cfg, check_files=False)
    assert msg == f"{flag} /proc/meshlm-test/x cannot be created (No such file or directory); " \
                  f"give a folder you can write to"


def test_checking_an_output_folder_leaves_nothing_behind(tmp_path):
    cfg = small()
    cfg.checkpoint.save = str(tmp_path / "a" / "b" / "ckpt")
    validate(cfg, world=1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind, noted", [("HuggingFaceTokenizer", True), ("Llama2Tokenizer", True),
                                         ("NullTokenizer", False), ("TikTokenizer", False)])
def test_vocab_size_with_a_tokenizer_file_is_noted_as_ignored(kind, noted):
    """`--tokenizer-model tok.json --vocab-size 50` trained the file's 300 ids without a word."""
    cfg = small()
    cfg.data.mock_data, cfg.data.data_path = False, ["d_text_document"]
    cfg.data.tokenizer_type, cfg.data.tokenizer_model, cfg.model.vocab_size = kind, "tok.json", 50
    said = [line for line in notes(cfg) if line.startswith("--vocab-size 50 ignored with ")]
    assert bool(said) == noted
    cfg.data.tokenizer_type = None  # implied by --tokenizer-model: HuggingFaceTokenizer
    assert any(line.startswith("--vocab-size 50 ignored with HuggingFaceTokenizer") for line in notes(cfg))


@pytest.mark.parametrize("key, value, words", [("tensor_model_parallel_size", None, "an integer (default 1)"),
                                                ("bf16", None, "true or false (default False)"),
                                                ("data_path", None, "a list (default [])")])
def test_a_yaml_null_for_a_field_without_an_unset_state_is_one_line(key, value, words):
    """`parallel: {tensor_model_parallel_size: null}` in --config ended in a TypeError traceback."""
    from meshlm.config import apply_mapping
    cfg = Config()
    with pytest.raises(ConfigError, match=f"c.yaml: {key.replace('_', '-')} is null but has no unset state; give "
                                          f"{re.escape(words)} or leave the key out"):
        apply_mapping(cfg, {key: value}, "c.yaml")
    apply_mapping(cfg, {"train_iters": None, "run_dir": None}, "c.yaml")  # these may be unset
    assert cfg.training.train_iters is None
    with pytest.raises(ConfigError, match=r"c.yaml: 'model' is a section: give a mapping of its keys \(e.g. model: "
                                          r"\{num_layers: …\}\) or a preset name, not 3"):  # was "unknown key 'model'"
        apply_mapping(cfg, {"model": 3}, "c.yaml")
