# FlexMARL on a CUDA host: vLLM, torch and CuPy (NCCL) from the setup script's CUDA branch.
#   docker build -t flexmarl .
#   docker run --gpus all --network host flexmarl flexmarl run --out /runs/demo
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/flexmarl
COPY . .
RUN PYTHON=python3 bash scripts/setup_env.sh
ENV PATH=/opt/flexmarl/.venv/bin:$PATH
CMD ["flexmarl", "run"]
