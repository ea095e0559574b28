# mptrain with CUDA: `docker run --gpus all mptrain model=resnet50 precision=mixed`
# PyPI's Linux torch wheels carry their own CUDA runtime, cuDNN and NCCL, so a plain Python image
# serves; only the host's NVIDIA driver (and the container toolkit, for --gpus) comes from outside.
# torch is pinned to the release the GPU machines test (pyproject's minimum, README's first install);
# tests/test_packaging.py checks that this pin meets pyproject.toml's.
FROM python:3.12-slim

WORKDIR /opt/mptrain
COPY pyproject.toml README.md ./
COPY mptrain ./mptrain
COPY configs ./configs
# torchao adds real FP8 (precision=fp8 precision.backend=torchao) on sm89+ GPUs.
RUN pip install --no-cache-dir "torch==2.11.*" "torchvision==0.26.*" ".[digits,slurm,report,fp8]"

WORKDIR /work
ENV MPTRAIN_RUNS=/work/runs
ENTRYPOINT ["mptrain"]
CMD ["--help"]
