# mptrain on a CUDA PyTorch base image: `docker run --gpus all mptrain model=resnet50 precision=mixed`
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

WORKDIR /opt/mptrain
COPY pyproject.toml README.md ./
COPY mptrain ./mptrain
COPY configs ./configs
# torchao adds real FP8 (precision=fp8 precision.backend=torchao) on sm89+ GPUs.
RUN pip install --no-cache-dir ".[digits,slurm,report]" torchao

WORKDIR /work
ENV MPTRAIN_RUNS=/work/runs
ENTRYPOINT ["mptrain"]
CMD ["--help"]
