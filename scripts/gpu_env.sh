# Sourced by the GPU scripts (gpu_check.sh, gpu_check_data.sh), from the repository root: mptrain
# runs from this checkout, and the packages the GPU machine lacks (Hydra, omegaconf, antlr4,
# submitit, torchao) come from the wheels that scripts/gpu_wheels.sh put in .whl/ (carried by the
# device tool).
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "gpu: installing the carried wheels from .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
