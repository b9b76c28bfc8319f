"""Host memory of `meshlm convert`: exporting a ~200 MB Llama checkpoint peaks at the full model plus
one shard, and importing the Hugging Face folder back at about one model (the safetensors are read
tensor by tensor into the model; reading them into a dict first, as before, held two copies and more).

Measured in a fresh process as the growth of its peak resident set (VmHWM, reset through
/proc/self/clear_refs before each step; torch storages are invisible to tracemalloc). The model has many tensors, so
"one tensor" is small next to it; the margin above one model is the allocator's (freed init
temporaries not returned to the OS), and two copies would be 2× or more."""

import json
import os
import subprocess
import sys

import pytest
import torch

import meshlm
from test_launch import clean_env

SRC = os.path.dirname(os.path.dirname(meshlm.__file__))
pytestmark = pytest.mark.slow  # ~200 MB written, exported and imported: 20-30 s on 2 shared cores

MEASURE = """
import ctypes, gc, json, sys
from meshlm.checkpoint import convert

def status(key):  # kB in /proc/self/status
    return int(next(l for l in open("/proc/self/status") if l.startswith(key + ":")).split()[1]) * 1024

def grew(fn, *args, **kw):  # growth of the peak RSS (VmHWM) over the call, from a reset peak
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier steps freed goes back to the OS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS is now the current RSS
    before = status("VmHWM")
    fn(*args, **kw)
    return status("VmHWM") - before

ckpt, out, again, shard = sys.argv[1:5]
print(json.dumps({"export": grew(convert.export_hf, ckpt, out, max_shard_bytes=int(shard)),
                  "import": grew(convert.import_hf, out, again)}))
"""


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory):
    """(meshlm checkpoint, bytes of its weights): a 16-layer Llama (hidden 512), ~207 MB fp32, imported
    from a Hugging Face folder written here in 4 shards."""
    from safetensors.torch import save_file

    from meshlm.checkpoint import convert
    tmp = tmp_path_factory.mktemp("big")
    h, inner, layers, vocab = 512, 1376, 16, 1024
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": h, "intermediate_size": inner, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": vocab, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": (inner, h), p + "mlp.up_proj.weight": (inner, h),
                       p + "mlp.down_proj.weight": (h, inner), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    names, weight_map = list(shapes), {}
    for k in range(4):
        file = f"model-{k + 1:05d}-of-00004.safetensors"
        part = {n: torch.full(shapes[n], 0.02) for n in names[k::4]}  # the values do not matter here
        save_file(part, str(tmp / "hf" / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (tmp / "hf" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    convert.import_hf(str(tmp / "hf"), str(tmp / "ckpt"))
    return str(tmp / "ckpt"), sum(torch.Size(s).numel() * 4 for s in shapes.values())


def test_export_and_import_hold_one_model(big_llama, tmp_path):
    ckpt, model_bytes = big_llama
    assert model_bytes > 200e6
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    shard = 40 * 10**6
    out, again = str(tmp_path / "out"), str(tmp_path / "again")
    run = subprocess.run([sys.executable, "-c", MEASURE, ckpt, out, again, str(shard)], capture_output=True,
                         text=True, timeout=300, env=clean_env(PYTHONPATH=SRC, HF_HUB_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    grew = json.loads(run.stdout.strip().splitlines()[-1])
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) >= 5  # one shard at a time
    assert grew["export"] < 1.3 * model_bytes + shard, \
        f"export: the peak grew {grew['export'] / model_bytes:.2f}× the model"
    assert grew["import"] < 1.5 * model_bytes, f"import: the peak grew {grew['import'] / model_bytes:.2f}× the model"
