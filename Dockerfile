# The GPU image of meshlm: a CUDA build of PyTorch with meshlm installed; `meshlm` is the entrypoint.
#   docker build -t meshlm .
#   docker run --gpus all --ipc=host -v $PWD:/workspace meshlm pretrain --config examples/gpt2-125m.yaml
# Another CUDA PyTorch base works too (torch >= 2.6), e.g. NVIDIA's NGC image:
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3 -t meshlm .
# On Slurm with pyxis/enroot: `enroot import dockerd://meshlm`, then examples/slurm/train.sbatch with
#   SRUN_ARGS="--container-image=./meshlm.sqsh --container-mounts=$PWD:$PWD --container-workdir=$PWD"
# (examples/slurm/README.md). --ipc=host (or a large --shm-size): the data-loader workers and
# NCCL share memory through /dev/shm.
# The tag: PyTorch 2.11 (the lent H200 machines' torch), CUDA 12.8; Docker Hub cannot be reached from
# here, the tag is the one public Dockerfiles pin (GitHub code search, 2026-12-03). CI builds this file
# on a CPU test base instead (.ci/container, --build-arg BASE_IMAGE=localhost/meshlm-test-base).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# NCCL: NVLink SHARP (multicast) off, as meshlm's own launcher sets it (1 on NVSwitch systems where
# multicast works); a failed or timed-out collective ends the worker instead of hanging the job.
# Cluster-specific settings come from `docker run -e` / the job's environment, not from the image:
# NCCL_SOCKET_IFNAME (bootstrap and socket interface), NCCL_IB_HCA (adapters), NCCL_IB_GID_INDEX
# (RoCE), NCCL_DEBUG=INFO (print topology and transports).
ENV NCCL_NVLS_ENABLE=0 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/meshlm
COPY pyproject.toml README.md ./
COPY src ./src
# the base image's torch satisfies meshlm's torch>=2.6: pip keeps it (no CPU wheel pulled in)
RUN pip install . && python -c "import meshlm.cli"
COPY examples ./examples

WORKDIR /workspace
ENTRYPOINT ["meshlm"]
CMD ["--help"]
