# The shapes the host-probe calls share (sourced by bench/host_probe_run.sh and bench/host_refit.sh):
# the common flags C, the few-token tail T, the dense reference D and the MoE layer M.
C="--mock-data --bf16 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2 --log-interval 1 --eval-interval 100000 --eval-iters 0"
T="--seq-length 256 --max-position-embeddings 256 --micro-batch-size 1"
D="--model llama-1b --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 --vocab-size 8192 $T"
M="--model mixtral-small --vocab-size 8192 --num-layers 8 --moe-ffn-hidden-size 896 $T"
