# Sourced by the GPU scripts (gpu-bench.sh, startup-bench.sh, warmup-ab.sh) from the repository root: the Python
# path to mlxhost's source, and to an MLX-CUDA wheel bundle when MLX_SITE_BUNDLE names one (a site-packages folder
# packed as .tar.xz, unpacked into /tmp/site); without it, whatever the environment has installed.
if [ -n "${MLX_SITE_BUNDLE:-}" ]; then
  mkdir -p /tmp/site && tar -xJf "$MLX_SITE_BUNDLE" -C /tmp/site
  export PYTHONPATH=/tmp/site:$PWD/src
  # Byte-compiled as pip's install would leave them: a first import does not compile them inside a start-up.
  python3 -m compileall -q -j0 /tmp/site "$PWD/src" > /dev/null
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
