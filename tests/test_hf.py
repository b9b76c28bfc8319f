"""checkpoint/hf.py, hf_config.py, convert.py: tiny random Hugging Face models (built from
transformers configs, no downloads) → meshlm at TP=1, TP=2 and PP=2 give transformers' logits;
meshlm's export loads back into transformers with the same logits; `pretrain --load <HF folder>`
fine-tunes from the HF model's loss; unsupported HF features are one-line errors."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from meshlm.checkpoint import convert
from meshlm.checkpoint.hf_config import flag_problems, model_from_hf
from meshlm.cli import main
from meshlm.errors import CheckpointError
from meshlm.training import generate, trainer
from test_trainer import tiny_config

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, ATOL = 100, 1e-5


def _hf_models():
    """arch → (tiny transformers model, save_pretrained max_shard_size). Llama: GQA (2 groups),
    rope_theta 5e4, untied; Mistral: 1 group, tied, a sliding window longer than the sequence;
    GPT-2: Conv1D weights, biases, learned positions, gelu_new, tied; Qwen2: q/k/v biases only, tied;
    Qwen3: per-head q/k RMSNorms, head dim 16 (not hidden / heads = 8), untied."""
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")
    return {
        "llama": (t.LlamaForCausalLM(t.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                                                   **common)), "20KB"),
        "mistral": (t.MistralForCausalLM(t.MistralConfig(num_key_value_heads=1, tie_word_embeddings=True,
                                                         sliding_window=64, **common)), None),
        "gpt2": (t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                attn_implementation="eager")), None),
        "qwen2": (t.Qwen2ForCausalLM(t.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)), None),
        "qwen3": (t.Qwen3ForCausalLM(t.Qwen3Config(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                                   **common)), None),
    }


def _scramble(model):
    """Weights far from transformers' init (std 0.02, norms 1), so every mapping shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name or ".ln_" in name
            p.copy_((1.0 if norm and name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{arch: (folder, model)} saved with save_pretrained (Llama sharded), plus "tokens" [2, 16]."""
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for arch, (model, shard) in _hf_models().items():
        _scramble(model)
        model.eval()
        folder = str(tmp / arch)
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        out[arch] = (folder, model)
    out["tokens"] = torch.randint(0, VOCAB, (2, 16))
    return out


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_fixture_models_are_what_the_tests_claim(hf):
    assert os.path.isfile(os.path.join(hf["llama"][0], "model.safetensors.index.json"))  # sharded import
    assert hf["llama"][1].config.rope_parameters["rope_theta"] == 5e4
    assert _logits(hf["gpt2"][1], hf["tokens"]).abs().max() > 1  # logits large enough to show a fault


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "qwen2", "qwen3"])
def test_import_at_tp1_gives_transformers_logits_and_export_loads_back(hf, arch, tmp_path):
    folder, model = hf[arch]
    ckpt = str(tmp_path / "ckpt")
    assert main(["convert", "--from-hf", folder, "--save", ckpt]) == 0
    ours, _ = generate.load_model(ckpt)
    expected = _logits(model, hf["tokens"])
    with torch.no_grad():
        got = ours(hf["tokens"])[..., :VOCAB]
    assert (got - expected).abs().max() < ATOL
    out = str(tmp_path / "out")
    arch_flag = ["--hf-architecture", "mistral"] if arch == "mistral" else []  # default: llama for RoPE, gpt2
    assert main(["convert", "--to-hf", "--load", ckpt, "--output", out, "--max-shard-size", "30KB"] + arch_flag) == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert (_logits(back, hf["tokens"]) - expected).abs().max() < ATOL


def test_a_tied_model_whose_file_also_holds_lm_head_imports_as_transformers_loads_it(hf, tmp_path):
    """Some tied models' files hold lm_head.weight beside the embedding; transformers ties the
    output layer and leaves it unread, meshlm refused the folder ("no place for lm_head.weight")."""
    import shutil
    from safetensors.torch import load_file, save_file
    folder = str(tmp_path / "mistral")
    shutil.copytree(hf["mistral"][0], folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    convert.import_hf(folder, str(tmp_path / "ckpt"))
    ours, _ = generate.load_model(str(tmp_path / "ckpt"))
    with torch.no_grad():
        assert (ours(hf["tokens"])[..., :VOCAB] - _logits(hf["mistral"][1], hf["tokens"])).abs().max() < ATOL


def test_a_tied_model_whose_file_holds_another_lm_head_is_refused_naming_both_ways_out(hf, tmp_path):
    """transformers 5 loads an lm_head.weight that differs from the tied embedding as an output layer
    of its own: meshlm imported the folder tied, silently another model (other logits)."""
    import shutil
    from safetensors.torch import load_file, save_file
    folder = str(tmp_path / "mistral")
    shutil.copytree(hf["mistral"][0], folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["lm_head.weight"][VOCAB - 1, 0] += 1
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight .* set "
                                              "\"tie_word_embeddings\": false in config.json"):
        convert.import_hf(folder, str(tmp_path / "ckpt"))


def test_a_converter_given_another_kind_of_folder_names_the_command_that_reads_it(hf, tmp_path):
    """--from-hf of a meshlm checkpoint, --from-megatron of a Hugging Face folder: "not a … folder", no more."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.megatron_convert import import_megatron
    mine = str(tmp_path / "mine")
    ckpt.save(mine, 1, {"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="; it is a meshlm checkpoint already: give it to --load"):
        convert.import_hf(mine, str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match="; it is a Hugging Face model folder: meshlm convert --from-hf reads it"):
        import_megatron(hf["qwen2"][0], str(tmp_path / "b"))


def test_import_of_a_folder_holding_a_fine_tunes_checkpoints_does_not_offer_it_to_load(hf, tmp_path, capsys):
    """An HF folder given as --save too holds the fine-tune's checkpoints: --load of it resumes them,
    not the HF weights the conversion read ("or --load FOLDER directly", it said)."""
    import shutil
    folder = str(tmp_path / "qwen2")
    shutil.copytree(hf["qwen2"][0], folder)
    (tmp_path / "qwen2" / "latest_checkpointed_iteration.txt").write_text("8")
    assert main(["convert", "--from-hf", folder, "--save", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"(--load {folder} resumes the meshlm checkpoints saved into "
                                                    f"it instead)")


@pytest.mark.parametrize("shard_bytes", [1 << 20, 40])
def test_exported_files_get_the_mode_of_any_new_file(tmp_path, shard_bytes):
    """model*.safetensors get 0666 less the umask, as config.json does (safetensors alone writes 0600)."""
    from meshlm.checkpoint.hf import write_hf_folder
    mask = os.umask(0o022)
    try:
        files = write_hf_folder(str(tmp_path), {"a": torch.zeros(8), "b": torch.ones(8)}, {"x": 1}, shard_bytes)
    finally:
        os.umask(mask)
    assert len(files) == (2 if shard_bytes > 64 else 4)  # 40: a shard per tensor, the index
    assert {f: oct(os.stat(tmp_path / f).st_mode & 0o777) for f in files} == {f: "0o644" for f in files}


def _gather_vocab(logits, ps):
    from meshlm.parallel import comm
    return comm.all_gather(logits.contiguous(), ps.tp_group, -1) if ps.tp > 1 else logits


def _parallel_logits(rank, world, sources, tokens):
    """{(arch, source, layout): logits [2, 16, VOCAB]} on the last stage's rank 0 (None elsewhere),
    each model built at TP=2 or PP=2 and filled by convert.load_weights from ``sources``."""
    import torch.distributed as dist

    from meshlm.model.transformer import GPTModel
    from meshlm.parallel.mesh import ParallelState
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        ps = ParallelState.build(tp, pp)
        for (arch, kind), path in sources.items():
            model_cfg = convert._hf_model(sources[(arch, "hf")], "--load").model_config()
            model_cfg.seq_length = 16
            layers = range(0, 1) if pp > 1 and ps.pp_rank == 0 else range(1, 2) if pp > 1 else None
            model = GPTModel(model_cfg, ps, VOCAB, seed=7, layer_ids=layers, pre_process=ps.is_first_stage,
                             post_process=ps.is_last_stage).eval()
            convert.load_weights([model], model_cfg, path)
            with torch.no_grad():
                if pp == 1:
                    logits = _gather_vocab(model(tokens), ps)
                elif ps.is_first_stage:
                    dist.send(model(tokens).contiguous(), 1)
                    logits = None
                else:
                    hidden = torch.empty(16, 2, model_cfg.hidden_size)
                    dist.recv(hidden, 0)
                    logits = model(None, hidden_states=hidden)
            if rank == world - 1:
                out[(arch, kind, f"tp{tp}pp{pp}")] = logits[..., :VOCAB]
    return out


def test_tp2_and_pp2_from_hf_folder_and_converted_checkpoint_give_transformers_logits(hf, tmp_path):
    sources = {}
    for arch in ("llama", "mistral", "gpt2"):
        sources[(arch, "hf")] = hf[arch][0]
        sources[(arch, "meshlm")] = str(tmp_path / arch)
        convert.import_hf(hf[arch][0], sources[(arch, "meshlm")])
    got = run_distributed(_parallel_logits, 2, sources, hf["tokens"])[1]
    assert len(got) == 12
    for (arch, _, _), logits in got.items():
        assert (logits - _logits(hf[arch][1], hf["tokens"])).abs().max() < ATOL


def _finetune_config(tmp, folder, zero3=False):
    """One step from the Hugging Face folder on mock data (vocabulary 100, 16 tokens), at TP=2 or
    (zero3) at DP=2 under ZeRO-3."""
    cfg = tiny_config(tmp, tp=1 if zero3 else 2, iters=1, micro=1 if zero3 else 2, global_batch=2)
    if zero3:
        cfg.parallel.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.model = convert._hf_model(folder, "--load").model_config(cfg.model)
    cfg.model.make_vocab_size_divisible_by = 16
    cfg.optimizer.lr_warmup_iters = 0  # the one step changes the weights
    cfg.training.eval_iters = 1
    cfg.checkpoint.load, cfg.checkpoint.save = folder, os.path.join(tmp, "ckpt")
    return cfg


def _finetune(rank, world, tmp, folder, zero3):
    return trainer.pretrain(_finetune_config(tmp, folder, zero3))


@pytest.mark.parametrize("zero3", [False, True])
def test_pretrain_load_of_a_hf_folder_fine_tunes_from_its_loss_and_exports(hf, tmp_path, zero3):
    """ZeRO-3 too: its weights live in shards, so the load makes them whole first (it wrote into
    freed storage: a segmentation fault)."""
    from meshlm.data.gpt_dataset import build_datasets
    folder, model = hf["llama"]
    summary = run_distributed(_finetune, 2, str(tmp_path), folder, zero3)[0]
    assert summary["iterations"] == 1
    train, _, _ = build_datasets(_finetune_config(str(tmp_path), folder), world_size=2)
    tokens = torch.stack([train[i]["tokens"] for i in range(2)])
    labels = torch.stack([train[i]["labels"] for i in range(2)])
    expected = F.cross_entropy(_logits(model, tokens).reshape(-1, VOCAB), labels.reshape(-1)).item()
    assert abs(summary["train_losses"][0] - expected) / expected < 1e-5
    # the TP=2 checkpoint of one fine-tuning step exports to transformers with meshlm's logits
    out = str(tmp_path / "out")
    convert.export_hf(str(tmp_path / "ckpt"), out)
    ours, _ = generate.load_model(str(tmp_path / "ckpt"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        mine = ours(hf["tokens"])[..., :VOCAB]
    assert (mine - _logits(model, hf["tokens"])).abs().max() > 1e-3  # the step changed the weights
    assert (_logits(back, hf["tokens"]) - mine).abs().max() < ATOL


# ----------------------------------------------------------------------------- errors

def _config(hf, arch, **changes):
    d = hf[arch][1].config.to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, field", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters.rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "bert"}, "model_type"),
])
def test_unsupported_hf_features_are_one_line_errors_naming_the_field(hf, changes, field):
    with pytest.raises(CheckpointError) as e:
        model_from_hf(_config(hf, "llama", **changes), "x/config.json")
    assert f"{field}=" in str(e.value) and "\n" not in str(e.value)


def test_run_flags_are_checked_against_the_hf_model(hf):
    m = model_from_hf(_config(hf, "mistral", sliding_window=8), "x/config.json")
    assert m.notes and "sliding_window=8" in m.notes[0]
    wrong = m.model_config()
    wrong.hidden_size, wrong.seq_length, wrong.norm_epsilon = 64, 16, 1e-5
    problems = flag_problems(m, wrong, "HF")
    assert "--hidden-size hf=32 now=64" in problems[0] and "--swiglu" in problems[0]
    assert "--norm-epsilon hf=1e-06 now=1e-05" in problems[0]  # rms_norm_eps was not compared
    assert "sliding_window=8 is shorter than --seq-length 16" in problems[1]
    right = m.model_config()
    right.seq_length = 8
    assert flag_problems(m, right, "HF") == []


def test_pretrain_refuses_a_hf_folder_of_another_shape_before_starting(hf, tmp_path, capsys):
    argv = ["pretrain", "--load", hf["llama"][0], "--mock-data", "--vocab-size", "100", "--dry-run",
            "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is a Hugging Face llama model of another shape" in err and "--num-query-groups 2" in err


def test_convert_flags_and_outputs_are_checked(hf, tmp_path, capsys):
    assert main(["convert", "--from-hf", hf["gpt2"][0]]) == 2
    assert "--from-hf needs --save (or --output)" in capsys.readouterr().err
    assert main(["convert", "--from-hf", hf["gpt2"][0], "--save", "a", "--output", "b"]) == 2
    assert "--save a and --output b name two folders" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(tmp_path), "--save", str(tmp_path / "c")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err
    ckpt = str(tmp_path / "c")
    assert main(["convert", "--from-hf", hf["gpt2"][0], "--output", ckpt]) == 0  # an import's folder: either flag
    capsys.readouterr()
    assert main(["checkpoint", "verify", ckpt]) == 0  # it said "(model, optimizer, scheduler, RNG)"
    assert "through the trainer (model weights: a weights-only checkpoint" in capsys.readouterr().out
    assert main(["convert", "--from-hf", hf["gpt2"][0], "--save", ckpt]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["convert", "--to-hf", "--load", ckpt, "--output", hf["gpt2"][0]]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert main(["convert", "--to-hf", "--load", ckpt, "--output", str(tmp_path / "o"),
                 "--hf-architecture", "llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--position-embedding-type learned_absolute; a Hugging Face llama model needs rope" in err
    assert len(err.splitlines()) == 1


def test_an_import_whose_config_disagrees_with_its_weights_names_config_json_not_flags(hf, tmp_path, capsys):
    """convert --from-hf takes no model flag, yet a config.json that disagrees with the safetensors
    (n_positions 16 beside [32, 32] position embeddings) ended "; pass the model's flags"."""
    folder = tmp_path / "gpt2"
    shutil.copytree(hf["gpt2"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["n_positions"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--from-hf", str(folder), "--save", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pass the model's flags" not in err, err
    assert f"fix {folder / 'config.json'}" in err and "position_embeddings.weight is [32, 32]" in err
    assert "--max-position-embeddings" not in err, err  # a flag convert does not take
    assert not (tmp_path / "c").exists()  # the failed import left an empty --save folder behind


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_folder(hf, tmp_path, monkeypatch):
    """safetensors' "os error 28" was a SafetensorError traceback, and the folder stayed behind
    with a tokenizer.json and no weights."""
    from meshlm.checkpoint import convert
    from meshlm.errors import ConfigError
    ckpt = str(tmp_path / "ckpt")
    assert main(["convert", "--from-hf", hf["llama"][0], "--save", ckpt]) == 0

    def full_disk(*args, **kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(convert, "write_hf_folder", full_disk)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"^--output {out}: no space left in {out} .*; free space there"):
        convert.export_hf(ckpt, str(out))
    assert not out.exists()
    out.mkdir()  # an empty folder given: emptied again, kept
    with pytest.raises(ConfigError):
        convert.export_hf(ckpt, str(out))
    assert os.listdir(out) == []


@pytest.mark.parametrize("act, form", [("gelu_new", "tanh"), ("gelu", "exact")])
def test_a_gpt2_is_loaded_by_any_flags_that_give_its_gelu(act, form):
    """A meshlm GPT-2 exported (default fused bias-GeLU, tanh) came back as `gelu_new` = --openai-gelu,
    and `pretrain --load hf-dir` with the flags it was trained with was refused as another shape."""
    import dataclasses

    hf = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 16,
          "activation_function": act}
    m = model_from_hf(hf, "x/config.json")
    base = dataclasses.replace(m.model_config(), openai_gelu=False, bias_gelu_fusion=True)  # meshlm's default
    tanh = [base, dataclasses.replace(base, openai_gelu=True, bias_gelu_fusion=False)]
    exact = [dataclasses.replace(base, bias_gelu_fusion=False)]
    for flags in (tanh if form == "tanh" else exact):
        assert flag_problems(m, flags, "HF") == []
    [problem] = flag_problems(m, (exact if form == "tanh" else tanh)[0], "HF")
    assert f"GeLU hf={form} now={'exact' if form == 'tanh' else 'tanh'}" in problem
