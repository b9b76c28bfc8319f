#!/bin/bash
# A Llama-3-8B-shaped model on 2 nodes × 8 GPUs with meshlm, launched the way Megatron-LM's
# example scripts launch pretrain_gpt.py: torchrun, then Megatron's flags grouped in arrays.
# Every flag below is one of Megatron-LM's and means here what it means there.
#
# Run this script on every node (NODE_RANK=0 on the first, 1 on the second):
#   NODE_RANK=0 MASTER_ADDR=node0 examples/train_llama3_8b_distributed.sh \
#       ckpt tb tokenizer.json data/train_text_document data/valid_text_document
# Leave out the fifth argument to cut one dataset into train/valid/test by --split instead.
# DRY_RUN=1 checks the whole launch (flags, files, layout, memory per rank) on any machine,
# starting nothing: `meshlm pretrain <the same flags> --dry-run --world-size 16`.

set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_JSON TRAIN_DATA_PATH [VALID_DATA_PATH]" \
         "(DRY_RUN=1 for a dry run; see the comment at the top)" >&2
    exit 2
fi
CHECKPOINT_PATH=$1        # where checkpoints go (and are resumed from)
TENSORBOARD_LOGS_PATH=$2  # TensorBoard scalars
TOKENIZER_MODEL=$3        # a Hugging Face tokenizer.json
TRAIN_DATA_PATH=$4        # a `meshlm preprocess` prefix (PREFIX_text_document), or a blend: "0.7 A 0.3 B"
VALID_DATA_PATH=${5:-}    # optional: a separate validation set (prefix or blend)

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --attention-backend auto  # accepted; attention is torch SDPA
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --train-iters 250000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --bf16
    --lr 3.0e-4
    --lr-decay-style cosine
    --min-lr 3.0e-5
    --lr-warmup-iters 2000
    --lr-decay-iters 250000
    --recompute-activations
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 4
    --sequence-parallel
    --pipeline-model-parallel-size 2
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

if [ -n "$VALID_DATA_PATH" ]; then
    # each split its own data; --split is then an error, as in Megatron-LM
    # shellcheck disable=SC2206  # a blend is several words
    SPLIT_DATA=(--train-data-path $TRAIN_DATA_PATH --valid-data-path $VALID_DATA_PATH)
else
    # shellcheck disable=SC2206
    SPLIT_DATA=(--data-path $TRAIN_DATA_PATH --split 949,50,1)
fi
DATA_ARGS=(
    "${SPLIT_DATA[@]}"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --num-workers 2
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

if [ "${DRY_RUN:-0}" = 1 ]; then
    LAUNCH=("${PYTHON:-python}" -m meshlm pretrain --dry-run --world-size $((GPUS_PER_NODE * NUM_NODES)))
else
    LAUNCH=(torchrun "${DISTRIBUTED_ARGS[@]}" -m meshlm pretrain)
fi

"${LAUNCH[@]}" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
