import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# scripts/gpu_check.sh runs the unit tests with EMAPG_TEST_DEVICE=cuda: every tensor a test makes
# without naming a device is then made on the GPU.
if os.environ.get("EMAPG_TEST_DEVICE"):
    import torch

    torch.set_default_device(os.environ["EMAPG_TEST_DEVICE"])
