"""Planner memory model: seed figures, Korthikanti et al. 2022 activation figures, meshlm's own bytes."""

import argparse

import pytest
import torch

from meshlm.config import ModelConfig, add_config_args, config_from_args
from meshlm.presets import PRESETS
from meshlm.planner.layout import FULL, SELECTIVE, Layout
from meshlm.planner.memory import estimate, layer_bytes, layer_terms, state_bytes


def cfg_of(*argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_seed_figures_175b_classic_mixed_precision():
    # 175e9 params: fp16 weights 2 B, fp16 grads 2 B, fp32 master + 2 Adam moments 12 B
    st = state_bytes(175e9, accounting="classic")
    assert st == {"weights": 350e9, "grads": 350e9, "optimizer": 2100e9}
    total = sum(st.values())
    assert total == 2800e9
    assert -(-total // 80e9) == 35  # ≥ 35 GPUs of 80 GB before activations
    # meshlm accumulates in fp32 main_grads: 4 B of grads, 3150 GB in all; ZeRO-1 over 8 divides the 12
    ours = state_bytes(175e9)
    assert ours["grads"] == 700e9 and sum(ours.values()) == 3150e9
    assert state_bytes(175e9, dp=8, distributed_optimizer=True)["optimizer"] == 2100e9 / 8


def _gpt(h, a, L, s=2048):
    return ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                       hidden_dropout=0.1, attention_dropout=0.1)


# Korthikanti et al. 2022 §4 (Table 2 forms), math attention (flash=False), b = 1, s = 2048, t = 8:
# GPT-3 175B: h 12288, a 96: sbh = 2048·12288 = 25,165,824; 5as/h = 5·96·2048/12288 = 80
#   no parallelism sbh·(34 + 80)            = 2,868,903,936
#   TP 8:  sbh·(10 + 24/8 + 80/8) = sbh·23  =   578,813,952
#   TP 8 + SP: sbh·114/8                    =   358,612,992
#   TP 8 + SP + selective: sbh·34/8         =   106,954,752
#   full recompute + SP: 2·sbh/8            =     6,291,456
# MT-NLG 530B: h 20480, a 128: sbh = 41,943,040; 5as/h = 64
#   no parallelism sbh·98 = 4,110,417,920; TP 8 + SP sbh·98/8 = 513,802,240; + selective sbh·34/8 = 178,257,920
@pytest.mark.parametrize("h,a,layout,expected", [
    (12288, 96, Layout(), 2_868_903_936),
    (12288, 96, Layout(tp=8), 578_813_952),
    (12288, 96, Layout(tp=8, sequence_parallel=True), 358_612_992),
    (12288, 96, Layout(tp=8, sequence_parallel=True, recompute=SELECTIVE), 106_954_752),
    (20480, 128, Layout(), 4_110_417_920),
    (20480, 128, Layout(tp=8, sequence_parallel=True), 513_802_240),
    (20480, 128, Layout(tp=8, sequence_parallel=True, recompute=SELECTIVE), 178_257_920),
])
def test_korthikanti_activation_figures(h, a, layout, expected):
    assert layer_bytes(_gpt(h, a, 96), 1, layout, flash=False) == pytest.approx(expected, rel=1e-12)


def test_full_recompute_and_flash_terms():
    m = _gpt(12288, 96, 96)
    assert layer_bytes(m, 1, Layout(tp=8, sequence_parallel=True), checkpointed=True) == 6_291_456
    # flash: no s² term; SDPA keeps its output (2·s·b·a·d) and log-sum-exp (4·a·s·b) instead
    terms = layer_terms(m, 1, tp=8, sp=True, flash=True)
    assert terms["core_attention"] == (2 * 2048 * 12288 + 4 * 96 * 2048) / 8


def test_interleaved_in_flight_is_megatrons_penalty():
    cfg = cfg_of("--model", "gpt3-175b", "--vocab-size", "50257", "--global-batch-size", "64", "--bf16")
    one = estimate(cfg, Layout(tp=8, pp=8, sequence_parallel=True), 50257)
    two = estimate(cfg, Layout(tp=8, pp=8, vp=2, sequence_parallel=True), 50257)
    assert one.in_flight == 8  # 1F1B: the first stage holds p micro-batches of its layers
    assert two.in_flight == pytest.approx(8 * (1 + 7 / 16))  # p·(1 + (p−1)/(p·v))
    assert two.activations == pytest.approx(one.activations * (1 + 7 / 16))


def test_one_stage_estimate_is_that_stages_and_the_default_the_larger():
    cfg = cfg_of("--model", "gpt3-175b", "--vocab-size", "50257", "--global-batch-size", "64", "--bf16")
    lay = Layout(tp=8, pp=8, sequence_parallel=True)
    first, last = (estimate(cfg, lay, 50257, stage=s) for s in (0, 7))
    assert (first.stage, last.stage) == (0, 7)
    assert first.in_flight == 8 and last.in_flight == 1 and last.loss > 0 == first.loss
    assert estimate(cfg, lay, 50257).peak_bytes == max(first.peak_bytes, last.peak_bytes)


def test_llama1b_calibration_point():
    # bench/results.jsonl: llama-1b, micro 8, seq 2048, bf16, fast path: peak 36.73 GiB
    cfg = cfg_of("--model", "llama-1b", "--num-attention-heads", "16", "--untie-embeddings-and-output-weights",
                 "--vocab-size", "32000", "--seq-length", "2048", "--max-position-embeddings", "2048",
                 "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16")
    mem = estimate(cfg, Layout.of(cfg, 1), 32000)
    assert not mem.grads_at_peak  # one micro-batch, PP 1: grads are allocated only during backward
    assert mem.peak_bytes / 2 ** 30 == pytest.approx(36.73, rel=0.03)


def _built_state(rank, world, argv):
    from meshlm.training.trainer import build
    run = build(cfg_of(*argv), torch.float32)
    weights = sum(b.param_data.numel() * b.param_data.element_size() for b in run.ddp.buffers)
    optim = sum(t.numel() * t.element_size() for s in run.opt.shards for t in (s.exp_avg, s.exp_avg_sq))
    grads = sum(b.numel * b.grad_dtype.itemsize for b in run.ddp.buffers)
    return {"weights": weights, "grads": grads, "optimizer": optim}


def test_planned_state_matches_a_built_cpu_run():
    from distributed import run_distributed
    argv = ["--model", "tiny", "--mock-data", "--vocab-size", "256", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "1"]
    built = run_distributed(_built_state, 1, argv)[0]
    cfg = cfg_of(*argv)
    mem = estimate(cfg, Layout.of(cfg, 1), 256, half=False)  # CPU trains in fp32: 4 + 4 + 8 bytes
    assert {"weights": mem.weights, "grads": mem.grads, "optimizer": mem.optimizer} == built


def test_bf16_moments_hold_and_move_four_bytes_a_parameter_less():
    """--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: the optimizer's
    state is 4 + 2 + 2 bytes a parameter (not 12), and the update moves 2 × 4 bytes less (cost.py)."""
    from meshlm.planner.cost import step_time
    from meshlm.planner.gpus import PRESETS as GPUS
    base = ("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "1024", "--max-position-embeddings",
            "1024", "--micro-batch-size", "2", "--global-batch-size", "4", "--bf16")
    full = cfg_of(*base)
    narrow = cfg_of(*base, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
    lay = Layout.of(full, 1)
    a, b = estimate(full, lay, 32000), estimate(narrow, lay, 32000)
    assert b.optimizer == pytest.approx(a.optimizer * 8 / 12, rel=1e-12) and a.params == b.params
    ta, tb = (step_time(c, lay, GPUS["H200-141GB"], 32000, gpus_per_node=1, params_per_rank=a.params)
              for c in (full, narrow))
    assert ta.optimizer - tb.optimizer == pytest.approx(8 * a.params / GPUS["H200-141GB"].hbm_bytes_per_s, rel=1e-9)


def test_grad_reduce_in_bf16_halves_the_gradients_and_their_dp_bytes():
    """--grad-reduce-in-bf16: the bf16 buckets hold 2 bytes a parameter (not 4) through the step, and
    the DP reduction moves 2 a parameter; each micro-batch's fold moves 4 bytes less and the update and
    norm 2 each (cost.py)."""
    from meshlm.planner.cost import step_time
    from meshlm.planner.gpus import PRESETS as GPUS
    base = ("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "1024", "--max-position-embeddings",
            "1024", "--micro-batch-size", "2", "--global-batch-size", "16", "--bf16")
    fp32, bf16 = cfg_of(*base), cfg_of(*base, "--grad-reduce-in-bf16")
    lay = Layout.of(fp32, 4)  # DP 4, 2 micro-batches: the buckets are summed, so half_grads does not apply
    a, b = estimate(fp32, lay, 32000), estimate(bf16, lay, 32000)
    assert b.grads == pytest.approx(a.grads / 2, rel=1e-12) and a.params == b.params
    h200 = GPUS["H200-141GB"]
    ta, tb = (step_time(c, lay, h200, 32000, gpus_per_node=8, params_per_rank=a.params) for c in (fp32, bf16))
    assert tb.dp_comm < 0.6 * ta.dp_comm
    assert ta.optimizer - tb.optimizer == pytest.approx((4 * 2 + 2 + 2) * a.params / h200.hbm_bytes_per_s, rel=1e-9)


def test_zero3_gathers_the_weights_whole_only_to_read_a_weights_only_load(tmp_path):
    """ZeRO-3 saves and loads meshlm checkpoints as its shards; a --load of a Hugging Face folder is
    read into the weights made whole (gather_all), beside the shards, so the peak is at least shards
    + whole weights + optimizer + grads. Other stages and other flags count nothing for it."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"")
    base = ("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "1024", "--max-position-embeddings",
            "1024", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16")
    for strategy, gathers in (("optim_grads_params", True), ("optim", False)):
        flags = base + ("--data-parallel-sharding-strategy", strategy)
        plain, saving, loading = (cfg_of(*flags, *extra) for extra in ((), ("--save", str(tmp_path / "ckpt")),
                                                                       ("--load", str(folder))))
        lay = Layout.of(plain, 8)
        a, b, c = (estimate(x, lay, 32000) for x in (plain, saving, loading))
        assert a.checkpoint_gather == b.checkpoint_gather == 0.0 and b.peak_bytes == a.peak_bytes
        assert c.checkpoint_gather == (2 * c.params if gathers else 0.0)
        if gathers:
            assert c.peak_bytes == pytest.approx(c.weights + 2 * c.params + c.optimizer + c.grads, rel=1e-12)
            assert c.peak_bytes > a.peak_bytes
        else:
            assert c.peak_bytes == a.peak_bytes


def test_end_of_backward_copy_leaves_out_the_adopted_experts():
    """At the end of a backward every param's p.grad waits beside the buckets for the fold (a copy of
    the weights), except the routed experts' stacks under half_grads, whose buckets take the grouped
    GEMM's gradient as it is (parallel/data.py ``adopt``); FP8 experts are copied (session 18: 32
    experts of width 896, predicted with the whole copy, +7.9%)."""
    base = ("--model", "mixtral-small", "--vocab-size", "32000", "--seq-length", "512", "--max-position-embeddings",
            "512", "--num-experts", "32", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "896",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16")
    for extra, copied in (((), "dense"), (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"), "all"),
                          (("--global-batch-size", "2"), "all")):  # two micro-batches: fp32 buckets, all copied
        cfg = cfg_of(*base, *extra)
        mem = estimate(cfg, Layout.of(cfg, 1), 32000)
        weights = mem.weights * ((mem.params - mem.expert_params) / mem.params if copied == "dense" else 1.0)
        state = mem.weights + weights + mem.optimizer + mem.grads
        resting = mem.weights + mem.optimizer + mem.activations + mem.loss + (mem.grads if mem.grads_at_peak else 0)
        assert state > resting and mem.expert_params > 0.9 * mem.params  # the copy sets the peak here
        assert mem.peak_bytes == pytest.approx(state, rel=1e-12), extra


def test_compiled_fp8_layer_keeps_no_fp8_copies_of_its_inputs():
    """The tensorwise FP8 linears at TP = 1 trace into the compiled layer, whose partitioner casts their
    inputs again in backward from tensors kept anyway (bench/saved_bytes.py on the compiled GPT-2.7B and
    Llama layers, session 20): the layer keeps the bf16 terms less the QKV and MLP inputs and the
    activation output. Predicted with four FP8 copies kept, the FP8 GPT-2.7B run at s 1k, b 8 was +8.3%."""
    base = ("--model", "gpt3-2.7b", "--num-layers", "4", "--vocab-size", "50304", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16")
    bf16 = layer_terms(cfg_of(*base).model, 8)
    recast = layer_terms(cfg_of(*base).model, 8, fp8=True, fp8_recomputed=True)
    assert recast == dict(bf16, qkv_input=0.0, mlp_input=0.0, activation_output=0.0)
    fp8 = ("--fp8-format", "hybrid")
    acts = {r: estimate(c, Layout.of(c, 1), 50304).activations
            for r in ("tensorwise", "delayed") for c in [cfg_of(*base, *fp8, "--fp8-recipe", r)]}
    s, b, h = 1024, 8, 2560
    kept = s * b * h * (1 + 1 + 1 + 4)  # the four FP8 inputs (the fc2 input 4h wide), a byte an element
    assert acts["delayed"] - acts["tensorwise"] == pytest.approx(4 * (kept - 2 * s * b * h), rel=1e-12)
