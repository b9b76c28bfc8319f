"""Mixtral through checkpoint/hf.py and hf_config.py: a tiny random ``MixtralForCausalLM`` (built
from a transformers config, no downloads) imported at EP=1 and EP=2 gives transformers' logits
(fp32, 1e-5); meshlm's export loads back into transformers with the same logits; what meshlm's
MoE cannot express is a one-line error naming the field or flag."""

import copy
import os

import pytest
import torch

from distributed import run_distributed
from meshlm.checkpoint import convert
from meshlm.checkpoint.hf_config import flag_problems, hf_config_from_model, model_from_hf
from meshlm.cli import main
from meshlm.errors import CheckpointError
from meshlm.training import generate
from test_hf import ATOL, VOCAB, _logits, _scramble

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
EXPERTS = 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(folder, model, tokens [2, 16]): 2 layers, 4 experts top-2, GQA 2 groups, weights scrambled."""
    t = transformers
    torch.manual_seed(0)
    model = t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager"))
    _scramble(model)
    model.eval()
    folder = str(tmp_path_factory.mktemp("mixtral") / "hf")
    model.save_pretrained(folder)
    return folder, model, torch.randint(0, VOCAB, (2, 16))


def test_import_at_ep1_gives_transformers_logits_and_export_loads_back(mixtral, tmp_path):
    folder, model, tokens = mixtral
    expected = _logits(model, tokens)
    ckpt = str(tmp_path / "ckpt")
    assert main(["convert", "--from-hf", folder, "--save", ckpt]) == 0
    ours, _ = generate.load_model(ckpt)
    assert sum(".local_experts." in n for n, _ in ours.named_parameters()) == 2 * 2 * EXPERTS
    with torch.no_grad():
        got = ours(tokens)[..., :VOCAB]
    assert (got - expected).abs().max() < ATOL
    # every token's routing matters: with the experts of one layer swapped the logits move
    assert (expected - _logits(_swap_experts(model), tokens)).abs().max() > 1e-2
    out = str(tmp_path / "out")
    assert main(["convert", "--to-hf", "--load", ckpt, "--output", out]) == 0  # default: mixtral for MoE
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert (_logits(back, tokens) - expected).abs().max() < ATOL


def _swap_experts(model):
    """A copy of ``model`` with layer 0's experts 0 and 1 exchanged (the router unchanged)."""
    import copy
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.model.layers[0].mlp.experts.parameters():
            p[[0, 1]] = p[[1, 0]].clone()
    return other


def _ep_logits(rank, world, sources, tokens):
    """{source: logits [2, 16, VOCAB]} of the model at EP=2 (DP=2), filled by convert.load_weights
    from each source, every rank running the same tokens (its own experts; the rest over all-to-all)."""
    from meshlm.model.transformer import GPTModel
    from meshlm.parallel.mesh import ParallelState
    ps = ParallelState.build(1, 1, 1, 2)
    out = {}
    for kind, path in sources.items():
        model_cfg = convert._hf_model(sources["hf"], "--load").model_config()
        model_cfg.seq_length = 16
        model = GPTModel(model_cfg, ps, VOCAB, seed=7).eval()
        local = {n for n, _ in model.named_parameters() if ".local_experts." in n}
        assert len(local) == 2 * 2 * EXPERTS // 2  # 2 layers × (fc1, fc2) × this rank's 2 experts
        convert.load_weights([model], model_cfg, path)
        with torch.no_grad():
            out[kind] = model(tokens)[..., :VOCAB]
    return out


def test_import_at_ep2_gives_transformers_logits(mixtral, tmp_path):
    folder, model, tokens = mixtral
    sources = {"hf": folder, "meshlm": str(tmp_path / "ckpt")}
    convert.import_hf(folder, sources["meshlm"])
    expected = _logits(model, tokens)
    for rank, got in enumerate(run_distributed(_ep_logits, 2, sources, tokens)):
        for kind, logits in got.items():
            assert (logits - expected).abs().max() < ATOL, (rank, kind)


def test_what_meshlm_cannot_express_is_one_line(mixtral):
    _, model, _ = mixtral
    hf = model.config.to_dict()
    with pytest.raises(CheckpointError, match="router_jitter_noise=0.01"):
        model_from_hf(dict(hf, router_jitter_noise=0.01), "x/config.json")
    m = model_from_hf(hf, "x/config.json")
    wrong = m.model_config()
    wrong.num_experts, wrong.seq_length = 8, 16
    (problem,) = flag_problems(m, wrong, "HF")
    assert "--num-experts hf=4 now=8" in problem and "--num-experts 4 --moe-router-topk 2" in problem
    sigmoid = m.model_config()
    sigmoid.moe_router_score_function = "sigmoid"
    with pytest.raises(CheckpointError, match="--moe-router-score-function sigmoid; a Hugging Face mixtral"):
        hf_config_from_model(sigmoid, VOCAB)
    with pytest.raises(CheckpointError, match="--num-experts 4; a Hugging Face llama model needs None"):
        hf_config_from_model(m.model_config(), VOCAB, "llama")


def test_a_dense_or_partly_moe_model_asked_for_mixtral_names_its_moe_layers(mixtral):
    """A dense model exported with --hf-architecture mixtral was told '--moe-layer-freq (MoE layers) 0;
    … needs 2' (the layer count, read as a frequency)."""
    _, model, _ = mixtral
    m = model_from_hf(model.config.to_dict(), "x/config.json").model_config()
    layers = m.num_layers
    dense = copy.deepcopy(m)
    dense.num_experts = None
    with pytest.raises(CheckpointError, match=rf"MoE layers \(--num-experts, --moe-layer-freq\) 0 of {layers}; "
                                              rf"a Hugging Face mixtral model needs {layers} of {layers}"):
        hf_config_from_model(dense, VOCAB, "mixtral")
    half = copy.deepcopy(m)
    half.num_layers, half.moe_layer_freq = 2, 2
    with pytest.raises(CheckpointError, match=r"MoE layers \(--num-experts, --moe-layer-freq\) 1 of 2;"):
        hf_config_from_model(half, VOCAB, "mixtral")
