# FlexMARL on a CUDA host: vLLM, torch and CuPy (NCCL), installed by the same setup script
# as everywhere else, told to take its CUDA branch (an image build sees no GPU).
#   docker build -t flexmarl .
#   docker run --gpus all --network host flexmarl flexmarl run --out /runs/demo
# Several hosts: run scripts/start_controller.sh in one container and scripts/start_workers.sh
# in the others (FLEXMARL_SKIP_SETUP=1: the image is already set up), sharing CURVE keys.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/flexmarl
COPY . .
RUN PYTHON=python3 FLEXMARL_TARGET=cuda bash scripts/setup_env.sh
ENV PATH=/opt/flexmarl/.venv/bin:$PATH FLEXMARL_SKIP_SETUP=1
CMD ["flexmarl", "run"]
