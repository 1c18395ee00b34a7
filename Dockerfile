# Paphos on an NVIDIA GPU.
#
#   docker build -t paphos .
#   docker run --gpus all -p 2242:2242 -v paphos-cache:/cache paphos                 # the bundled default model
#   docker run --gpus all -p 2242:2242 -v paphos-cache:/cache -e HF_TOKEN paphos org/name --max-model-len 8k
#   docker run --gpus all -p 2242:2242 -v paphos-cache:/cache -v "$PWD/models:/models:ro" \
#       paphos /models/model.Q4_K_M.gguf                                              # a file of the host
#
# The entry point is `paphos run --host 0.0.0.0`; whatever follows the image name is appended, so
# the first word is the model (a Hugging Face repo id, or a path inside the container) and the rest
# are `paphos run` flags.
# CMD is empty on purpose: no argument serves the bundled SmolLM2-135M-Instruct, as `paphos run`
# does. The image needs a driver for CUDA 13 on the host (R580 or newer) and the NVIDIA Container
# Toolkit (`--gpus`).

# torch 2.13.0 from PyPI's default index is built for CUDA 13.0 (it pulls cuda-toolkit 13.0.x
# wheels), so the base image is CUDA 13.0. For an older driver, build with a CUDA 12 torch and a
# matching base: TORCH_INDEX=https://download.pytorch.org/whl/cu12X (an index that carries this
# torch release) and CUDA_IMAGE=nvidia/cuda:12.X.Y-runtime-ubuntu24.04.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# The torch release the test suite runs against (Makefile's TORCH_SPEC); empty TORCH_INDEX = PyPI.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# python3-dev and gcc: Triton compiles a small C launcher per kernel signature the first time it
# runs (it needs a C compiler and Python.h), and Paphos's GPU path is Triton kernels. Versions are
# those of the base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04's Python is "externally managed": install into a virtual environment.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv

# torch in a layer of its own (the largest, and unchanged by edits to Paphos); TORCH_SPEC pins it.
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "${TORCH_SPEC}"

# The same build as `pip install .` in a checkout: pyproject.toml, the README it names as the
# package description, and the package.
COPY pyproject.toml README.md /tmp/paphos-src/
COPY paphos /tmp/paphos-src/paphos
RUN pip install /tmp/paphos-src \
    && rm -rf /tmp/paphos-src

# An unprivileged user (Ubuntu 24.04 images already have `ubuntu` as uid 1000).
RUN groupadd --gid 10001 paphos \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin paphos \
    && mkdir -p /cache/huggingface /cache/paphos /cache/triton \
    && chown -R paphos:paphos /cache

# Downloaded models (Hugging Face cache, the bundled default model) and Triton's compiled kernels
# live in one volume, so a restarted container neither downloads nor compiles again. A host
# directory mounted here must be writable by uid 10001.
ENV HF_HOME=/cache/huggingface \
    PAPHOS_CACHE_DIR=/cache/paphos \
    TRITON_CACHE_DIR=/cache/triton
VOLUME ["/cache"]

# Numeric, so that a platform can check it is not root without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/paphos
EXPOSE 2242

# /health answers 503 while the model loads and after an engine failure, 200 when ready; urllib
# raises on a non-2xx answer, so the exit status is the verdict. A large model can take minutes
# to load and compile: the start period covers that. Checks port 2242: a container started with
# --port N needs its own --health-cmd.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:2242/health', timeout=4)"]

# Inside a container the server must listen on every interface (Paphos binds 127.0.0.1 by
# default); a later `--host` argument still wins.
ENTRYPOINT ["paphos", "run", "--host", "0.0.0.0"]
CMD []
